"""A pre-LN GPT as the RMSNorm GPT that computes the same function (Jiang et al. 2023, "Pre-RMSNorm and Pre-CRMSNorm
Transformers: Equivalent and Efficient Pre-LN Transformers"), in memory: every vector written into the residual stream
centred (the rows of the token and position embeddings, the columns and bias of each output projection), so that the
stream has zero mean at every layer and each LayerNorm, whose first act is to remove that mean, equals an RMSNorm of
the same gain, bias and eps; a tied LM head untied. The arithmetic in float64, cast back to the model's dtype. One
implementation for normlab-convert (interop/convert.py) and a branch's converted arm (training/branch.py)."""

import dataclasses
from functools import partial

import torch
from torch import nn

from normlab.common.errors import NormlabError
from normlab.model import norms
from normlab.model.gpt import GPT, GPTConfig, NormFactory

EMBEDDINGS = ("wte.weight", "wpe.weight")  # [rows, d]: each row is written into the residual stream
OUTPUT_PROJECTIONS = ("attn.c_proj", "mlp.c_proj")  # Linear [d, d_in]: each column and the bias are written into it


class ConvertError(NormlabError):
    """A model that cannot be converted (normlab-convert, a branch: training/branch.py), or an out= that
    normlab-convert must not write."""


def centred(tensor: torch.Tensor, dim: int | None) -> torch.Tensor:
    """`tensor` minus its mean along `dim` (None: over all of it), in float64, cast back to its dtype."""
    x = tensor.double()
    mean = x.mean() if dim is None else x.mean(dim=dim, keepdim=True)
    return (x - mean).to(tensor.dtype)


def changed_by_centring(name: str) -> bool:
    """Whether centred_weights changes the parameter `name` (of a normlab GPT's state dict, without prefix)."""
    writers = tuple(f"{p}.{kind}" for p in OUTPUT_PROJECTIONS for kind in ("weight", "bias"))
    return name in EMBEDDINGS or name.endswith(writers)


def centred_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict of a normlab GPT with every vector it writes into the residual stream centred. lm_head.weight
    keeps its values, also when tied (a tied model's state dict names the shared matrix twice)."""
    result = dict(weights)
    for name, tensor in weights.items():
        if not changed_by_centring(name):
            continue
        if name in EMBEDDINGS:
            result[name] = centred(tensor, dim=1)
        elif name.endswith(".weight"):
            result[name] = centred(tensor, dim=0)  # the mean over the d output rows of each column
        else:
            result[name] = centred(tensor, dim=None)  # a bias
    return result


def built(config: GPTConfig, norm: NormFactory, weights: dict[str, torch.Tensor]) -> GPT:
    """A normlab GPT holding `weights` (copied, in their dtype), in eval mode; built on the meta device, so that no
    random initialisation is paid for."""
    with torch.device("meta"):
        model = GPT(config, norm)
    model = model.to(weights["wte.weight"].dtype).to_empty(device=weights["wte.weight"].device)
    model.load_state_dict(weights)
    return model.eval()


def layernorm_of(model: GPT, what: str = "the model") -> norms.LayerNorm:
    """The final LayerNorm of `model`, once every norm of it is checked to be one; `what` names the model in the
    error."""
    for norm in model.norm_layers():
        check_convertible(norm, what)
    return model.ln_f


def check_convertible(norm: nn.Module, what: str) -> None:
    """A LayerNorm (normlab's or torch's), else ConvertError naming `what` (the model it is of)."""
    traits = norms.traits(norm)
    if traits.centring_pair and not traits.centres:
        raise ConvertError(f"{what} is already an RMSNorm model: nothing to convert (a LayerNorm model converts "
                           "into an RMSNorm one)")
    if not norms.is_layernorm(norm):
        raise ConvertError(f"{what} has {type(norm).__name__} norms: only a LayerNorm model converts exactly into "
                           "an RMSNorm one")


def converted(model: GPT, what: str = "the model") -> GPT:
    """The RMSNorm GPT that computes what the pre-LN GPT `model` computes: the same weights, those that write into
    the residual stream centred, the LM head untied, each LayerNorm an RMSNorm of the same gain, bias and eps."""
    layernorm = layernorm_of(model, what)
    config = dataclasses.replace(model.config, tie_embeddings=False)
    rms_norm = partial(norms.RMSNorm, eps=layernorm.eps, bias=layernorm.bias is not None)
    return built(config, rms_norm, centred_weights(model.state_dict()))
