"""GPT-2 pre-norm decoder, as in appendix A.1 of the paper:

    f = N1(h);  a = Att(f);  g = N2(h + a);  m = MLP(g);  h' = h + a + m

with a final norm N_f before the LM head. N is LayerNorm, RMSNorm, DyT (train/normlab/model/norms.py) or a norm of
the user's, passed in as a factory; nothing else in the model depends on it.
"""

import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from normlab.common.errors import ConfigError
from normlab.model.head_loss import head_loss

NormFactory = Callable[[int], nn.Module]
SITE_KINDS = ("attention", "mlp", "final")  # the norms before attention (ln_1), before the MLP (ln_2), before the head


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int = 1024
    vocab_size: int = 50257
    tie_embeddings: bool = False
    dropout: float = 0.0  # on embeddings, attention weights and residual writes (the paper, like Pythia: 0)

    def __post_init__(self):
        for field in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            if getattr(self, field) < 1:
                raise ConfigError(f"model.{field} must be positive, got {getattr(self, field)}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}: "
                "choose n_head among the divisors of n_embd"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, attention_norm: NormFactory, mlp_norm: NormFactory):
        super().__init__()
        self.ln_1 = attention_norm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = mlp_norm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h))
        return h + self.mlp(self.ln_2(h))


class GPT(nn.Module):
    """`norm` builds every norm layer but those of a site kind (SITE_KINDS) that `sites` gives a factory of its own
    (DyT's alpha_init per site kind, as its paper sets it for language models)."""

    def __init__(self, config: GPTConfig, norm: NormFactory, sites: Mapping[str, NormFactory] | None = None):
        super().__init__()
        unknown = set(sites or {}) - set(SITE_KINDS)
        if unknown:
            raise ConfigError(f"unknown norm site kind {sorted(unknown)[0]!r}: the kinds are {', '.join(SITE_KINDS)}")
        factory = {kind: (sites or {}).get(kind, norm) for kind in SITE_KINDS}
        self.config, self.norm_factory = config, norm
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, factory["attention"], factory["mlp"]) for _ in range(config.n_layer))
        self.ln_f = factory["final"](config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        # How it computes, not what (runtime: in conf/train.yaml): recompute each block in the backward pass to save
        # memory; the loss's chunk of tokens and the head's rows padded to a multiple of head_rows_multiple
        self.activation_checkpointing, self.loss_chunk, self.head_rows_multiple = False, 8192, 1

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, head: bool = True) -> torch.Tensor:
        """Logits; with `targets` the mean next-token loss (model/head_loss.py: never the whole float32 logits); with
        head=False the final norm's output (what the angle study needs). Through the module's call, so that the hooks
        of a sharded model gather its parameters."""
        h = self.hidden(idx)
        if targets is not None:
            return head_loss(h, self.lm_head.weight, targets, self.loss_chunk, self.head_rows_multiple)
        return self.lm_head(h) if head else h

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """The final norm's output: everything but the LM head (all the angle study needs)."""
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={self.config.block_size}")
        h = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for block in self.blocks:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                h = checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        return self.ln_f(h)

    def norm_layers(self) -> list[nn.Module]:
        """Every norm layer, in the order of the forward pass: each block's two, then the final one."""
        return [*(norm for block in self.blocks for norm in (block.ln_1, block.ln_2)), self.ln_f]

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 initialisation in which every matrix draws from its own generator, seeded by
        (seed, parameter name). Identical names get identical values whatever the norm layers are,
        so LN, RMS and DyT models built with the same seed share every non-norm parameter exactly. The norms set their
        own parameters, drawing nothing (gains 1, biases 0, DyT's alpha its initial value): by their
        reset_parameters(), else as their constructor left them (a user's plain module)."""
        proj_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        norms = self.norm_layers()
        for norm in norms:
            if hasattr(norm, "reset_parameters"):
                norm.reset_parameters()
        of_norms = {id(p) for norm in norms for p in norm.parameters()}
        for name, p in self.named_parameters():
            if id(p) in of_norms:
                continue
            if p.dim() == 1:  # biases start at 0 (the gains of a norm of another kind at 1)
                p.fill_(0.0 if name.endswith("bias") else 1.0)
                continue
            digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
            generator = torch.Generator(device=p.device).manual_seed(int.from_bytes(digest[:8], "little"))
            p.normal_(0.0, proj_std if name.endswith("c_proj.weight") else 0.02, generator=generator)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count. Non-embedding leaves out the token and position embeddings and the
        (untied) output embedding, as in Kaplan et al."""
        total = sum(p.numel() for p in self.parameters())  # a tied matrix is counted once
        if non_embedding:
            total -= self.wte.weight.numel() + self.wpe.weight.numel()
            if not self.config.tie_embeddings:
                total -= self.lm_head.weight.numel()
        return total

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward): 6 per weight of every matrix multiply,
        LM head included, plus 12 L T d for the attention scores and their weighted sum."""
        c = self.config
        matmul_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul_weights + 12 * c.n_layer * c.block_size * c.n_embd
