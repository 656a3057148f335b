"""Checks of a composed training config that need neither data nor weights: every value that would crash with a
traceback, or do the wrong thing and exit 0, is refused here in one line (ConfigError), before anything is written.
The data module, the model config and the run directory check their own settings when they are built."""

import dataclasses
import inspect
import math
import os

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from normlab.common.errors import ConfigError

SPECIAL_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}
MODEL_KEYS = {"name", "lr"}  # model preset keys besides GPTConfig's fields: its name and its peak learning rate


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(name: str, value) -> None:
    if not is_int(value) or value < 1:
        raise ConfigError(f"{name}={value}: give a positive whole number")


def fraction(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
        raise ConfigError(f"{name}={value}: give a number between 0 and 1")


def unknown_keys(name: str, node: DictConfig, allowed: set[str]) -> None:
    unknown = sorted(set(node) - allowed - SPECIAL_KEYS)
    if unknown:
        raise ConfigError(f"unknown key {name}.{unknown[0]} (added with +?): {name} takes "
                          f"{', '.join(sorted(allowed))}")


def check_arguments(name: str, node: DictConfig) -> None:
    """The keys of an object config (`_target_`) must be parameters of its target (unless it takes **kwargs)."""
    try:
        target = get_object(node._target_)
    except Exception:
        raise ConfigError(f"{name}._target_={node._target_} cannot be imported: check its spelling") from None
    parameters = inspect.signature(target).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return
    unknown = sorted(set(node) - {p.name for p in parameters} - SPECIAL_KEYS)
    if unknown:
        raise ConfigError(f"unknown key {name}.{unknown[0]} (added with +?): {node._target_} has no parameter "
                          f"'{unknown[0]}'; remove it, or check its spelling")


def finite(name: str, value) -> None:
    """Refuse inf, -inf and nan anywhere in a setting (a resolved config tree): they would run until the first
    step turns them into a non-finite loss, or not fail at all."""
    if isinstance(value, dict):
        for key, item in value.items():
            finite(f"{name}.{key}" if name else str(key), item)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            finite(f"{name}[{i}]", item)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}={value}: give a finite number")


def check_slurm_tasks(devices) -> None:
    """Under a Slurm batch job, one task per device: Lightning starts no processes of its own there."""
    tasks = os.environ.get("SLURM_NTASKS_PER_NODE")
    interactive = os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive")
    if tasks and not interactive and str(devices) != tasks.split("(")[0]:
        raise ConfigError(f"Slurm runs {tasks} tasks per node but trainer.devices={devices}: set --ntasks-per-node "
                          "equal to the devices per node (one task per GPU)")


def check_train_config(cfg: DictConfig) -> None:
    from normlab.model.gpt import GPTConfig

    if not str(cfg.run_dir).strip():
        raise ConfigError("run_dir is empty: give the run's directory, e.g. run_dir=checkpoints/myrun")
    if not is_int(cfg.seed) or not 0 <= cfg.seed < 2**32:
        raise ConfigError(f"seed={cfg.seed}: give a whole number from 0 to 2**32 - 1")
    finite("", OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True))
    if cfg.global_batch_size is not None:
        positive_int("global_batch_size", cfg.global_batch_size)
    fraction("schedule.warmup_fraction", cfg.schedule.warmup_fraction)
    fraction("schedule.min_lr_ratio", cfg.schedule.min_lr_ratio)
    lr = cfg.optimizer.get("lr")
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr > 0:
        raise ConfigError(f"optimizer.lr={lr} (model.lr): give a positive learning rate")
    for key in ("max_steps", "val_check_interval", "num_nodes"):
        positive_int(f"trainer.{key}", cfg.trainer.get(key))
    clip = cfg.trainer.get("gradient_clip_val")
    if clip is not None and (not isinstance(clip, (int, float)) or isinstance(clip, bool) or clip < 0):
        raise ConfigError(f"trainer.gradient_clip_val={clip}: give a number >= 0 (0 or null: no clipping)")
    check_slurm_tasks(cfg.trainer.devices)
    if str(cfg.trainer.strategy).startswith("fsdp"):
        raise ConfigError(f"trainer.strategy={cfg.trainer.strategy} would shard the whole model as one unit: use "
                          "strategy=fsdp (one transformer block per unit; normlab/training/strategies.py)")
    if str(cfg.trainer.accelerator) in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"trainer.accelerator={cfg.trainer.accelerator} but this machine has no GPU that torch "
                              "can use: train on the CPU here (trainer=default, or trainer.accelerator=cpu)")
    unknown_keys("model", cfg.model, {f.name for f in dataclasses.fields(GPTConfig)} | MODEL_KEYS)
    objects = {"data": cfg.data, "optimizer": cfg.optimizer, "trainer": cfg.trainer, "norm.layer": cfg.norm.layer}
    objects.update({f"callbacks.{k}": v for k, v in cfg.callbacks.items()})
    objects.update({f"logger.{k}": v for k, v in cfg.logger.items()})
    for name, node in objects.items():
        if node is not None and "_target_" in node:
            check_arguments(name, node)
