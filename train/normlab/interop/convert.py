"""normlab-convert (conf/convert.yaml): a pre-LN model as an RMSNorm model that computes the same function (Jiang et
al. 2023, "Pre-RMSNorm and Pre-CRMSNorm Transformers: Equivalent and Efficient Pre-LN Transformers").

Every vector written into the residual stream is centred (its mean over the model dimension d removed): the rows of
the token and position embeddings, and the columns and bias of each output projection (attention's and the MLP's
c_proj). The stream then has zero mean at every layer, so each LayerNorm, whose first act is to remove that mean,
equals an RMSNorm with the same gain, bias and eps, the final norm included. A tied LM head is untied: it keeps the
original embeddings, since it reads the final norm's output, which is unchanged. The arithmetic is in float64, cast
back to the model's dtype.

The input is a normlab LayerNorm checkpoint (or a run directory's newest intact one) or a local Hugging Face GPT-2
directory, mapped into normlab's GPT (Conv1D weights transposed). The output is a new run directory of one
checkpoint, which every normlab command reads as model_path: config.yaml and checkpoints/step-NNNNNNN.ckpt with its
digest file. Its config is the source's with norm=rmsnorm_bias (rmsnorm for a LayerNorm without bias),
model.tie_embeddings=false, the directory's run_name and run_dir, and `converted_from` (command, path, step, norm).
"""

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from normlab.common import outputs
from normlab.common.paths import CONF_DIR
from normlab.model import norms
from normlab.model.conversion import ConvertError, built, centred_weights, converted
from normlab.model.gpt import GPT, GPTConfig
from normlab.training import loader
from normlab.training.rundir.checkpoints import write_checkpoint
from normlab.training.rundir.config import CONFIG_FILE
from normlab.training.rundir.files import RunDirError

COMMAND = "normlab-convert"
ACCEPTS = "a LayerNorm .ckpt, a run directory or a Hugging Face GPT-2 model directory"
__all__ = ["ConvertError", "centred_weights", "converted", "main"]  # the conversion itself: model/conversion.py


def rms_norm_config(norm: norms.RMSNorm) -> dict:
    """The norm config of the converted model, given one of its norms: conf/norm/rmsnorm_bias.yaml (rmsnorm.yaml
    without bias), resolved, with the norm's eps (the LayerNorm's)."""
    own = OmegaConf.load(CONF_DIR / "norm" / f"{norms.exact_rms_norm(norm.bias is not None)}.yaml")
    bases = [OmegaConf.load(CONF_DIR / "norm" / f"{n}.yaml") for n in own.pop("defaults", []) if n != "_self_"]
    config = OmegaConf.merge(*bases, own)  # its defaults list (rmsnorm_bias.yaml: rmsnorm), then itself
    config.layer.eps = norm.eps
    return OmegaConf.to_container(config, resolve=True)


# -- the sources: a normlab checkpoint, a Hugging Face GPT-2 directory


@dataclass
class Source:
    """A LayerNorm model to convert, with what the converted run's config and checkpoint take from it."""

    model: GPT  # normlab's GPT with LayerNorms, in eval mode
    config: dict  # a normlab run's config; of a Hugging Face model, what stands for it (seed, model name)
    hyper_parameters: dict  # the checkpoint's, but its config
    step: int
    path: Path  # the checkpoint or Hugging Face directory read, resolved
    norm: str  # the config's norm name


def is_hugging_face(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and not (path / "checkpoints").is_dir()


def normlab_source(path: Path) -> Source:
    """The checkpoint `path` names (a .ckpt, or a run directory's newest intact one), verified and loaded."""
    checkpoint, step, warnings = loader.chosen(path, ConvertError, ACCEPTS)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    raw = loader.read_checkpoint(checkpoint)
    config = loader.saved_config(raw)
    hyper_parameters = {k: v for k, v in raw["hyper_parameters"].items() if k != "config"}
    return Source(loader.load_model(checkpoint).eval(), config, hyper_parameters, step, checkpoint.resolve(),
                  config["norm"]["name"])


def gpt2_type(path: Path) -> None:
    """Refuse a Hugging Face directory whose model_type is not gpt2, in one line."""
    config_file = path / "config.json"
    try:
        model_type = json.loads(config_file.read_bytes()).get("model_type")
    except (ValueError, AttributeError):
        raise ConvertError(f"{config_file} is not a JSON object: restore the model's config.json") from None
    if model_type == "normlab_rms_gpt2":
        raise ConvertError(f"{path} is an RMSNorm model already (model type {model_type}, normlab-export's RMSNorm "
                           "GPT-2): nothing to convert")
    if model_type != "gpt2":
        raise ConvertError(f"{path}: model type {model_type}: normlab-convert converts Hugging Face GPT-2 models "
                           "(model type gpt2) only")


def check_gpt2_config(path: Path, config) -> None:
    """Refuse a GPT-2 whose blocks normlab's GPT does not compute (another activation, MLP width or attention
    scaling), in one line."""
    differences = [
        (config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"),
         f"activation_function={config.activation_function} (normlab: the tanh GELU, gelu_new)"),
        (config.n_inner not in (None, 4 * config.n_embd), f"n_inner={config.n_inner} (normlab: 4 n_embd)"),
        (not config.scale_attn_weights, "scale_attn_weights=false (normlab: scores / sqrt(head size))"),
        (config.scale_attn_by_inverse_layer_idx, "scale_attn_by_inverse_layer_idx=true"),
        (config.add_cross_attention, "add_cross_attention=true"),
    ]
    if found := [setting for differs, setting in differences if differs]:
        raise ConvertError(f"{path} is a GPT-2 that normlab's GPT does not compute: {', '.join(found)}")


def from_gpt2(hf_model) -> GPT:
    """transformers' GPT2LMHeadModel as normlab's LayerNorm GPT (the LM head untied, holding the model's own
    matrix): the names of interop.export read backwards, Conv1D weights transposed into nn.Linear's [out, in]."""
    from normlab.interop.export import CONV1D_WEIGHTS, hf_name

    c = hf_model.config
    config = GPTConfig(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, block_size=c.n_positions,
                       vocab_size=c.vocab_size, dropout=c.resid_pdrop)
    hf_weights = hf_model.state_dict()
    with torch.device("meta"):
        names = list(GPT(config, norms.LayerNorm).state_dict())
    weights = {name: hf_weights[hf_name(name)] for name in names}
    weights.update({name: w.t().contiguous() for name, w in weights.items() if name.endswith(CONV1D_WEIGHTS)})
    return built(config, partial(norms.LayerNorm, eps=c.layer_norm_epsilon), weights)


def hugging_face_source(path: Path) -> Source:
    """A local Hugging Face GPT-2 directory, loaded in the dtype its config.json names (float32 if another)."""
    from normlab.interop import pretrained

    gpt2_type(path)
    model_type, config = pretrained.model_config(path)
    check_gpt2_config(path, config)
    dtype = getattr(config, "dtype", None) if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    dtype = str(dtype or "float32").removeprefix("torch.")
    hf_model = pretrained.load_hugging_face(path, dtype if dtype in loader.DTYPES else "float32")
    step, identity = pretrained.identity(path, model_type, config)
    identity = pretrained.with_norm(identity, hf_model, model_type)
    stand_in = {"seed": identity["seed"], "model": {"name": identity["model"]}}
    return Source(from_gpt2(hf_model), stand_in, {}, step, path.resolve(), identity["norm"])


# -- the command (conf/convert.yaml)


def default_out(path: Path, step: int) -> Path:
    """Beside the source: <run>-rms for a run directory, <run>-rms-step-NNNNNNN for a checkpoint of one,
    <name>-rms for another .ckpt or a Hugging Face directory."""
    path = Path(os.path.abspath(path))
    if path.is_file() and path.parent.name == "checkpoints":
        run = path.parent.parent
        return run.with_name(f"{run.name}-rms-step-{step:07d}")
    return path.with_name(f"{path.stem if path.is_file() else path.name}-rms")


def check_out(out: Path) -> None:
    """`out` is a new path (never an existing one), outside any run directory or prepared corpus, and writable."""
    if out.exists() or out.is_symlink():
        raise ConvertError(f"out={out} exists: {COMMAND} writes a new run directory and never writes over "
                           "anything; give a new path")
    try:
        outputs.check_place(out, COMMAND)
        outputs.check_writable(out)
    except outputs.OutputError as e:
        raise ConvertError(str(e)) from None


def run_config(source: Source, model: GPT, out: Path) -> dict:
    """The converted run's config: the source's, with the converted model, its norm, the new directory and where it
    came from."""
    return {**source.config, "run_name": out.name, "run_dir": str(out),
            "model": {**source.config["model"], **dataclasses.asdict(model.config)},
            "norm": rms_norm_config(model.ln_f),
            "converted_from": {"command": COMMAND, "path": str(source.path), "step": source.step,
                               "norm": source.norm}}


def write(out: Path, model: GPT, config: dict, source: Source) -> Path:
    """The run directory `out`: config.yaml and checkpoints/step-NNNNNNN.ckpt (weights and config, with its digest
    file), written into a staging folder beside it and moved into place once complete. The checkpoint's path."""
    checkpoint = {"global_step": source.step,
                  "state_dict": {f"model.{name}": tensor for name, tensor in model.state_dict().items()},
                  "hyper_parameters": {**source.hyper_parameters, "config": config}}
    relative = Path("checkpoints") / f"step-{source.step:07d}.ckpt"
    try:
        with outputs.staging(out, COMMAND) as folder:  # new only: whatever appears at out meanwhile is left as it is
            outputs.write_file(folder / CONFIG_FILE, OmegaConf.to_yaml(OmegaConf.create(config)))
            write_checkpoint(checkpoint, folder / relative)
    except outputs.OutputError as e:
        raise ConvertError(str(e)) from None
    except RunDirError as e:
        raise ConvertError(f"cannot write {out}: {e}") from None
    except OSError as e:
        raise ConvertError(f"cannot write {out} ({e.strerror or e}): give a writable out=") from None
    return out / relative


def main(cfg: DictConfig) -> None:
    """normlab-convert (normlab.cli.convert): the LayerNorm model of `model_path` as the RMSNorm model that computes
    the same function, written as the new run directory `out` (conf/convert.yaml)."""
    if OmegaConf.is_missing(cfg, "model_path") or not str(cfg.model_path).strip():
        raise ConvertError("no model given: model_path=RUN_DIR, model_path=CHECKPOINT.ckpt or model_path=HF_GPT2_DIR")
    path = Path(str(cfg.model_path))
    if not path.exists():
        raise ConvertError(f"{path} does not exist: give {ACCEPTS}")
    source = hugging_face_source(path) if is_hugging_face(path) else normlab_source(path)
    model = converted(source.model, f"{source.path} (norm={source.norm})")
    out = Path(os.path.abspath(str(cfg.out))) if cfg.out is not None else default_out(path, source.step)
    check_out(out)
    config = run_config(source, model, out)
    checkpoint = write(out, model, config, source)
    print(f"wrote {out} ({config['norm']['name']}, {checkpoint.relative_to(out)}): it computes what {source.path} "
          f"({source.norm}, step {source.step}) computes")
