"""Norms of a user's own, as a user brings one: a class on PYTHONPATH (this module, in tests/, which pytest puts on
sys.path) that says nothing of what it is, so that model.norms.traits gives it the defaults: it normalizes, does not
centre, and is no member of the report's centring x bias 2x2."""

import torch
from torch import nn


class ScaleNorm(nn.Module):
    """ScaleNorm (Nguyen and Salazar 2019): g sqrt(d) x / |x|, with one scalar gain g."""

    def __init__(self, dim: int, eps: float = 1e-5, g_init: float = 1.0):
        super().__init__()
        self.scale, self.eps = dim**0.5, eps
        self.g = nn.Parameter(torch.full((1,), float(g_init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g * self.scale * x / x.norm(dim=-1, keepdim=True).clamp_min(self.eps)
