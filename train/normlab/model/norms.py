"""The norm layers: the only place where the LN, RMS and DyT models differ.

LayerNorm(x) = RMSNorm(x - mean(x) 1) * gamma + beta: LayerNorm removes the component of x along the
uniform vector 1 before rescaling; RMSNorm only rescales. Both use the same eps. Bias: LayerNorm keeps
its bias beta by default (as in GPT-2), RMSNorm has none (as in Llama), so an RMS model has (2L + 1) d fewer
parameters; either can be built with or without it (conf/norm/: layernorm_nobias, rmsnorm_bias), so that a 2x2
sweep separates the centring from the bias. Neither layer draws random numbers at construction (beta starts
at 0), so swapping one for the other leaves the random initialisation of every other parameter untouched.

DyT (Dynamic Tanh, Zhu et al. 2025, "Transformers without Normalization") is the third arm: no statistic of x at
all, gamma * tanh(alpha x) + beta, with one learnable scalar alpha per layer that starts at alpha_init (the paper's
default 0.5). It draws no random numbers either.
"""

import torch
import torch.nn.functional as F
from torch import nn

from normlab.model.fused_rmsnorm import rms_norm


class Norm(nn.Module):
    """A norm layer: a gain `weight` (and a `bias`) over the last dimension, set by reset_parameters without random
    draws (GPT.init_weights calls it)."""

    def __init__(self, dim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(1.0)
        if self.bias is not None:
            self.bias.zero_()


class LayerNorm(Norm):
    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__(dim, bias)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"


class RMSNorm(Norm):
    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = False):
        super().__init__(dim, bias)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_norm(x, self.weight, self.eps)  # F.rms_norm, with fused kernels on CPU
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"


class DyT(Norm):
    def __init__(self, dim: int, alpha_init: float = 0.5, bias: bool = True):
        super().__init__(dim, bias)
        self.alpha_init = alpha_init
        self.alpha = nn.Parameter(torch.full((1,), float(alpha_init)))  # one scalar per layer (the paper's shape)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.alpha.fill_(self.alpha_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.alpha * x) * self.weight
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, alpha_init={self.alpha_init}, bias={self.bias is not None}"
