"""The norm layers: the only place where the LN, RMS and DyT models differ, and the one place that says what a norm
is.

LayerNorm(x) = RMSNorm(x - mean(x) 1) * gamma + beta: LayerNorm removes the component of x along the
uniform vector 1 before rescaling; RMSNorm only rescales. Both use the same eps. Bias: LayerNorm keeps
its bias beta by default (as in GPT-2), RMSNorm has none (as in Llama), so an RMS model has (2L + 1) d fewer
parameters; either can be built with or without it (conf/norm/: layernorm_nobias, rmsnorm_bias), so that a 2x2
sweep separates the centring from the bias. Neither layer draws random numbers at construction (beta starts
at 0), so swapping one for the other leaves the random initialisation of every other parameter untouched.

DyT (Dynamic Tanh, Zhu et al. 2025, "Transformers without Normalization") is the third arm: no statistic of x at
all, gamma * tanh(alpha x) + beta, with one learnable scalar alpha per layer that starts at alpha_init (the paper's
default 0.5). It draws no random numbers either.

What normlab asks of any norm layer, normlab's or a user's, is answered here and nowhere else:
- `traits(module)`: whether it removes the component along 1 (`centres`), whether it divides its input by a
  statistic of it (`normalizes`), whether it has a bias (read from the module), and whether the report's centring x
  bias 2x2 pairs it with the other norms that say so (`centring_pair`: LayerNorm and RMSNorm, which differ only in
  the centring). A class says the first, second and fourth with the class attributes of `Norm`; a plain
  `nn.Module(dim, **args)` of the user's gets their defaults (no centring, normalizing, not paired).
- `without_centring(module, x)`: a centring norm's output with its centring skipped (the ablation's "uncentred");
  any other norm is ablated by centring its input, which needs nothing of the norm.
- `saved_per_token(norm_factory, width)`: what autograd keeps of the norm per token beside its input, measured on a
  small forward with saved-tensor hooks (the resource plan's count).
- `norm_class(target)` and `contract_violation(cls, arguments, width)`: the class of a `_target_`, imported with a
  line that says why it cannot be (not on the path, a missing dependency, a syntax error: file and line), and what
  keeps it from being a norm layer: built as cls(width, **arguments) with the width its first parameter, its output
  of its input's shape and finite on a probe input. Every command that builds a model asks them before anything is
  written (training.checks.check_norm, the report's arms).
"""

import importlib
import importlib.util
import inspect
import traceback
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# An exported model carries this module as its code (interop/norm_code.py): outside normlab, torch's rms_norm
try:
    from normlab.model.fused_rmsnorm import rms_norm
except ImportError:

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, eps)


class Norm(nn.Module):
    """A norm layer: a gain `weight` (and a `bias`) over the last dimension, set by reset_parameters without random
    draws (GPT.init_weights calls it). Subclasses say what they are with the class attributes."""

    centres = False  # removes the component of its input along 1 before anything else
    normalizes = True  # divides its input by a statistic of it (False: a point-wise map in a norm's place, DyT)
    centring_pair = False  # a member of the 2x2 that differs only in the centring and the bias (LayerNorm, RMSNorm)

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
    centres, centring_pair = True, True

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__(dim, bias)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"


def exact_rms_norm(bias: bool) -> str:
    """The norm (conf/norm/<name>.yaml) of the RMSNorm model that computes a LayerNorm model's function once its
    writers are centred (model/conversion.py), for a LayerNorm with or without `bias`: rmsnorm_bias or rmsnorm."""
    return "rmsnorm_bias" if bias else "rmsnorm"


class RMSNorm(Norm):
    centring_pair = True

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = False):
        super().__init__(dim, bias)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_norm(x, self.weight, self.eps)  # F.rms_norm, with fused kernels on CPU
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"


class DyT(Norm):
    normalizes = False

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


# -- what a norm is, for any norm layer


def source_of(obj) -> str:
    """The file that defines a class or module (for the lines that name it)."""
    try:
        return inspect.getsourcefile(obj) or "?"
    except TypeError:
        return "built in"


def import_failure(module: str, error: Exception) -> str:
    """Why `module` cannot be imported, in words that say what to do."""
    if isinstance(error, ModuleNotFoundError) and (error.name == module or module.startswith(f"{error.name}.")):
        return (f"no module {module} on the Python path: put the folder that holds {module.replace('.', '/')}.py on "
                "PYTHONPATH, or check the spelling")
    try:
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec else "?"
    except Exception:  # noqa: BLE001 (a parent package that fails to import)
        origin = "?"
    if isinstance(error, SyntaxError):
        return f"{error.filename}, line {error.lineno}: {error.msg}: fix the syntax of {module}"
    lines = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == origin]
    where = f"{origin}, line {lines[-1].lineno}" if lines else origin
    if isinstance(error, ModuleNotFoundError):
        return f"{module} ({where}) imports {error.name}, which is not installed here: install it"
    return f"importing {module} ({where}) fails: {type(error).__name__}: {str(error).strip().splitlines()[0]}"


def norm_class(target: str) -> type:
    """The class a norm's `_target_` names, imported; ValueError saying why it cannot be."""
    module, _, name = str(target).rpartition(".")
    if not module:
        raise ValueError(f"{target} names no module: give module.Class")
    try:
        imported = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 (whatever a user's module raises when imported)
        raise ValueError(import_failure(module, e)) from None
    if not hasattr(imported, name):
        raise ValueError(f"{module} ({source_of(imported)}) has no {name}: check the class's name")
    return getattr(imported, name)


def contract_violation(cls, arguments: dict[str, dict], width: int) -> str | None:
    """What keeps `cls` from serving as a norm layer, or None. A model builds it as cls(width, **arguments[site])
    for each site's settings: the width must be its first parameter (a positional one without a default, that no
    setting names); each layer's output on a probe input must have the input's shape and be finite."""
    try:
        parameters = [] if getattr(cls, "__init__", None) is nn.Module.__init__ else list(
            inspect.signature(cls).parameters.values())  # nn.Module's own takes *args: none of the class's
    except (TypeError, ValueError):  # a signature Python cannot read (a C extension): the probe tells
        parameters = None
    if parameters is not None:
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not positional and not any(p.kind is p.VAR_POSITIONAL for p in parameters):
            return "its constructor takes no width: make the width its first parameter, __init__(self, dim, ...)"
        if positional:
            first = positional[0]
            if first.default is not first.empty:
                return (f"its first parameter, {first.name}, has a default ({first.default!r}), and normlab passes "
                        f"the width there: make the width the first parameter, __init__(self, dim, {first.name}=...)")
            if named := [site for site, given in arguments.items() if first.name in given]:
                return (f"{named[0]} sets {first.name}, its first parameter, where normlab passes the width: remove "
                        "that setting")
    with torch.device("cpu"), torch.no_grad():
        x = torch.randn(2, 3, width, generator=torch.Generator().manual_seed(0))
        for site, given in arguments.items():
            with_settings = f" with {site}'s settings" if len(arguments) > 1 else ""
            try:
                y = cls(width, **given)(x)
            except Exception as e:  # noqa: BLE001 (whatever a user's class raises)
                return (f"building it at width {width}{with_settings} and running it fails: {type(e).__name__}: "
                        f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}")
            if not isinstance(y, torch.Tensor) or y.shape != x.shape:
                shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
                return (f"it returns {shape} for an input of shape {tuple(x.shape)}{with_settings}: a norm keeps its "
                        "input's shape")
            if not torch.isfinite(y).all():
                return f"it returns values that are not finite on a random input{with_settings}"
    return None


@dataclass(frozen=True)
class Traits:
    centres: bool
    normalizes: bool
    bias: bool
    centring_pair: bool


def is_torch_layernorm(module: nn.Module) -> bool:
    """torch's own LayerNorm over the last dimension: the norm of Hugging Face's GPT-2, GPT-NeoX and GPT-J."""
    return isinstance(module, nn.LayerNorm) and len(module.normalized_shape) == 1


def is_layernorm(module: nn.Module) -> bool:
    """Whether `module` computes LayerNorm's formula exactly (normlab's or torch's): what normlab-convert turns into
    an RMSNorm of the same gain, bias and eps, and what exports as GPT-2's own LayerNorm."""
    return type(module) is LayerNorm or is_torch_layernorm(module)


def traits(module: nn.Module) -> Traits:
    """What the norm layer `module` is (see the module's docstring); its class attributes, else their defaults."""
    centres = getattr(type(module), "centres", is_torch_layernorm(module))
    return Traits(
        centres=bool(centres),
        normalizes=bool(getattr(type(module), "normalizes", True)),
        bias=getattr(module, "bias", None) is not None,
        centring_pair=bool(getattr(type(module), "centring_pair", is_torch_layernorm(module))),
    )


def can_skip_centring(module: nn.Module) -> bool:
    """Whether without_centring knows the norm's output with its centring skipped: a LayerNorm's (normlab's or
    torch's), or a centring norm's own `without_centring(x)`."""
    return hasattr(module, "without_centring") or is_layernorm(module)


def without_centring(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A centring norm's output on `x` with its mean subtraction skipped, in float32: x / sqrt(mean(x^2) + eps) *
    gamma + beta for a LayerNorm (normlab's or torch's); a centring norm of another form provides its own
    `without_centring(x)`."""
    if hasattr(module, "without_centring"):
        return module.without_centring(x)
    with torch.autocast(x.device.type, enabled=False):
        x = x.float()
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps)
        if module.weight is not None:
            y = y * module.weight.float()
        if module.bias is not None:
            y = y + module.bias.float()
    return y


def saved_per_token(norm_factory, width: int, tokens: int = 4) -> int:
    """The float32 values that autograd keeps per token for the backward of a norm layer (`norm_factory(width)`)
    beside its input and its parameters: measured on a forward of a new layer on the CPU in float32, with saved-tensor
    hooks (LayerNorm: its mean and rstd, 2; RMSNorm: rstd, 1; DyT: tanh(alpha x), its width)."""
    with torch.device("cpu"):  # whatever device the caller builds on (the meta device, for a plan)
        layer = norm_factory(width).float()
        x = torch.randn(tokens, width, requires_grad=True)
    known = {x.untyped_storage().data_ptr(), *(p.untyped_storage().data_ptr() for p in layer.parameters())}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in known:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        layer(x)
    return round(sum(saved.values()) / 4 / tokens)
