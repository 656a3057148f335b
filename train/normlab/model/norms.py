"""The two normalization layers: the only place where the LN and RMS models differ.

LayerNorm(x) = RMSNorm(x - mean(x) 1) * gamma + beta: LayerNorm removes the component of x along the
uniform vector 1 before rescaling; RMSNorm only rescales. Both use the same eps. Bias: LayerNorm keeps
its bias beta by default (as in GPT-2), RMSNorm has none (as in Llama), so an RMS model has (2L + 1) d fewer
parameters; either can be built with or without it (conf/norm/: layernorm_nobias, rmsnorm_bias), so that a 2x2
sweep separates the centring from the bias. Neither layer draws random numbers at construction (beta starts
at 0), so swapping one for the other leaves the random initialisation of every other parameter untouched.
"""

import torch
import torch.nn.functional as F
from torch import nn

from normlab.model.fused_rmsnorm import rms_norm


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_norm(x, self.weight, self.eps)  # F.rms_norm, with fused kernels on CPU
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"
