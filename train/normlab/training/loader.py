"""Loading a trained normlab model, for every command that reads one (normlab-export, -sample, -eval, -ablate,
-angles): the checkpoint a user's path names (a .ckpt, or a run directory's newest intact one) verified against its
digest file, read memory-mapped, its saved config (the `_target_`s of classes that moved since it was written named
by their place now) and the model built from them in a dtype, on a device. Lightning is not imported here: a command
that only reads a checkpoint does not pay for it."""

from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from normlab.common.errors import NormlabError
from normlab.common.moved import current_config
from normlab.training.pipeline import build_model
from normlab.training.rundir.checkpoints import chosen_checkpoint, read_checkpoint
from normlab.training.rundir.claim import describe, training_holder
from normlab.training.rundir.files import RunDirError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ACCEPTS = "a .ckpt or a run directory"


def check_dtype(dtype: str, error: type[NormlabError]) -> None:
    """`dtype=` names one of DTYPES, else `error` (the command's own error class) says which it may name."""
    if dtype not in DTYPES:
        raise error(f"dtype={dtype}: give one of {', '.join(DTYPES)}")


def device_name(name, error: type[NormlabError]) -> str:
    """The device of `device=`: null is cuda when torch sees a GPU, else cpu; one torch does not know or see raises
    `error` (the command's own error class)."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(str(name))
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise error(f"unknown device={name}: give cpu, cuda or cuda:N")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise error(f"device={name}: torch sees {torch.cuda.device_count()} CUDA devices here: give "
                    "device=cpu, or one that it sees")
    return str(name)


def chosen(path: Path, error: type[NormlabError], accepts: str = ACCEPTS,
           named: str | None = None) -> tuple[Path, int, list[str]]:
    """The checkpoint `path` names (a .ckpt, or a run directory's newest intact checkpoint), verified against its
    digest file, with its step and a warning for each damaged checkpoint passed on the way (for the command to print).
    What is wrong raises `error`, the command's own error class; `accepts`: what the command takes, for the error;
    `named`: how the error names a path that does not exist (default: the path)."""
    if not path.exists():
        raise error(f"{named or path} does not exist: give {accepts}")
    try:
        checkpoint, step, warnings = chosen_checkpoint(path, accepts)
    except RunDirError as e:
        raise error(str(e)) from None
    run_dir = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
    if run_dir is not None and (holder := training_holder(run_dir)):
        warnings.append(f"{run_dir} is still being trained ({describe(holder)}): step {step} is a snapshot of a run "
                        "in progress, not its final weights")
    return checkpoint, step, warnings


def saved_config(checkpoint: dict) -> dict:
    """The run config a checkpoint (full or weights only) carries, as plain containers, what moved since it was
    written at its place now (common.moved.current_config)."""
    return current_config(OmegaConf.to_container(OmegaConf.create(checkpoint["hyper_parameters"]["config"])))


def load_model(path: Path, dtype: str = "float32") -> nn.Module:
    """The normlab model of a checkpoint, full or weights only (its config rides in the checkpoint), in `dtype`."""
    checkpoint = read_checkpoint(path)
    model = build_model(OmegaConf.create(saved_config(checkpoint)))
    weights = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    model.load_state_dict(weights)
    return model.to(DTYPES[dtype])
