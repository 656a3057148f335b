"""GPT-2 with RMSNorm in place of LayerNorm, for Hugging Face transformers: what normlab-export writes an RMSNorm
model as. Self-contained (torch and transformers only): normlab-export saves this file beside the weights, so that
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` loads the model without normlab; importing this
module registers the model type with the Auto classes, so that `from_pretrained(dir)` works without remote code.

RMSNorm(x) = x / sqrt(mean(x^2) + eps) * weight (+ bias when norm_bias), over the last dimension; every other
module is GPT-2's.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel


class NormlabRMSGPT2Config(GPT2Config):
    model_type = "normlab_rms_gpt2"

    def __init__(self, norm_bias: bool = False, **kwargs):
        self.norm_bias = norm_bias
        super().__init__(**kwargs)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, bias: bool):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return y if self.bias is None else y + self.bias


class NormlabRMSGPT2LMHeadModel(GPT2LMHeadModel):
    config_class = NormlabRMSGPT2Config

    def __init__(self, config: NormlabRMSGPT2Config):
        super().__init__(config)
        norm = lambda: RMSNorm(config.n_embd, config.layer_norm_epsilon, config.norm_bias)  # noqa: E731
        for block in self.transformer.h:
            block.ln_1, block.ln_2 = norm(), norm()
        self.transformer.ln_f = norm()
        self.post_init()


AutoConfig.register(NormlabRMSGPT2Config.model_type, NormlabRMSGPT2Config, exist_ok=True)
AutoModelForCausalLM.register(NormlabRMSGPT2Config, NormlabRMSGPT2LMHeadModel, exist_ok=True)
# save_pretrained then copies this file beside the weights and names it in config.json's auto_map
NormlabRMSGPT2Config.register_for_auto_class()
NormlabRMSGPT2LMHeadModel.register_for_auto_class("AutoModelForCausalLM")
