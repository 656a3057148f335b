"""GPT-2 with DyT (Dynamic Tanh) in place of LayerNorm, for Hugging Face transformers: what normlab-export writes a DyT
model as. Self-contained (torch and transformers only): normlab-export saves this file beside the weights, so that
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` loads the model without normlab; importing this
module registers the model type with the Auto classes, so that `from_pretrained(dir)` works without remote code.

DyT(x) = tanh(alpha x) * weight (+ bias when norm_bias), with one learnable scalar alpha per layer; every other module
is GPT-2's. A sibling of hf_rmsnorm_gpt2.py rather than one model whose norm a config field chooses: each exported
directory then carries only the code of its own norm, and the directories already exported as normlab_rms_gpt2
(whose config.json's auto_map names that file and its classes) load as they did. The class is named DyT, as
normlab-ablate recognises it.
"""

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel


class NormlabDyTGPT2Config(GPT2Config):
    model_type = "normlab_dyt_gpt2"

    def __init__(self, norm_bias: bool = True, alpha_init: float = 0.5, **kwargs):
        self.norm_bias = norm_bias
        self.alpha_init = alpha_init  # alpha before training: the trained value is in the weights
        super().__init__(**kwargs)


class DyT(nn.Module):
    def __init__(self, dim: int, alpha_init: float, bias: bool):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((1,), float(alpha_init)))
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.alpha * x) * self.weight
        return y if self.bias is None else y + self.bias


class NormlabDyTGPT2LMHeadModel(GPT2LMHeadModel):
    config_class = NormlabDyTGPT2Config

    def __init__(self, config: NormlabDyTGPT2Config):
        super().__init__(config)
        norm = lambda: DyT(config.n_embd, config.alpha_init, config.norm_bias)  # noqa: E731
        for block in self.transformer.h:
            block.ln_1, block.ln_2 = norm(), norm()
        self.transformer.ln_f = norm()
        self.post_init()


AutoConfig.register(NormlabDyTGPT2Config.model_type, NormlabDyTGPT2Config, exist_ok=True)
AutoModelForCausalLM.register(NormlabDyTGPT2Config, NormlabDyTGPT2LMHeadModel, exist_ok=True)
# save_pretrained then copies this file beside the weights and names it in config.json's auto_map
NormlabDyTGPT2Config.register_for_auto_class()
NormlabDyTGPT2LMHeadModel.register_for_auto_class("AutoModelForCausalLM")
