"""Checks of a composed training config that need neither data nor weights: every value that would crash with a
traceback, or do the wrong thing and exit 0, is refused here in one line (ConfigError), before anything is written.
The data module, the model config and the run directory check their own settings when they are built."""

import dataclasses
import functools
import inspect
import math
import os
import types
import typing
from pathlib import Path

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from normlab.common.errors import ConfigError
from normlab.common.outputs import enclosing, what_is
from normlab.common.paths import CONF_DIR

SPECIAL_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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


def shown(value) -> str:
    """A value as it is typed on the command line: true, false, null."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def one_of(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def accepted(annotation) -> list | None:
    """What a parameter annotated so takes, among the types a config can hold (bool, int, float, str, null, the
    values of a Literal); None where it may take anything else too (a Path, a tuple, a class...): not checked."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return accepted(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return [("literal", v) for v in typing.get_args(annotation)]
    if origin in (typing.Union, types.UnionType):
        kinds = [accepted(a) for a in typing.get_args(annotation)]
        return None if any(k is None for k in kinds) else [k for ks in kinds for k in ks]
    if annotation is None or annotation is type(None):
        return [type(None)]
    return [annotation] if annotation in (bool, int, float, str) else None


def takes(kind, value) -> bool:
    if isinstance(kind, tuple):  # a Literal's value: True is not 1
        return type(value) is type(kind[1]) and value == kind[1]
    if kind is float:
        return is_number(value)
    return is_int(value) if kind is int else isinstance(value, kind)


KIND_WORDS = {bool: ["true", "false"], int: ["a whole number"], float: ["a number"], str: ["a string"],
              type(None): ["null"]}


def check_type(name: str, value, parameter: inspect.Parameter) -> None:
    """A setting must have the type its parameter is annotated with (unannotated: the type of its default, where that
    is bool, int, float or str); null only where the annotation admits None or the default is None."""
    default = parameter.default
    if isinstance(parameter.annotation, str):  # an annotation that could not be evaluated
        return
    if parameter.annotation is not parameter.empty:
        kinds = accepted(parameter.annotation)
    elif type(default) in (bool, int, float, str):
        kinds = [type(default)]
    else:
        return
    if kinds is None or default is None and value is None:
        return
    if not any(takes(kind, value) for kind in kinds):
        words = [w for kind in dict.fromkeys(kinds) for w in (
            [shown(kind[1])] if isinstance(kind, tuple) else KIND_WORDS[kind])]
        raise ConfigError(f"{name}={shown(value)}: give {one_of(words)}")


def signature(target) -> inspect.Signature:
    try:
        return inspect.signature(target, eval_str=True)
    except Exception:  # an annotation naming what only type checkers import: those are left unchecked
        return inspect.signature(target)


def check_arguments(name: str, node: DictConfig) -> dict:
    """The keys of an object config (`_target_`) must be parameters of its target (unless it takes **kwargs), of
    the types of its signature. Returns the resolved settings that are parameters, by name."""
    try:
        target = get_object(node._target_)
    except Exception:
        from normlab.model.norms import norm_class

        try:
            norm_class(node._target_)  # says why: not on the path, a missing dependency, a syntax error
            why = "check its spelling"
        except ValueError as e:
            why = str(e)
        raise ConfigError(f"{name}._target_={node._target_} cannot be imported: {why}") from None
    parameters = signature(target).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        unknown = sorted(set(node) - set(parameters) - SPECIAL_KEYS)
        if unknown:
            raise ConfigError(f"unknown key {name}.{unknown[0]} (added with +?): {node._target_} has no parameter "
                              f"'{unknown[0]}'; remove it, or check its spelling")
    values = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k in parameters}
    for key, value in values.items():
        check_type(f"{name}.{key}", value, parameters[key])
    return values


# The ranges of the settings that torch's optimizers share, by name (their types come from the signature)
OPTIMIZER_RANGES = {
    "eps": (lambda v: v > 0, "a number > 0"),
    "weight_decay": (lambda v: v >= 0, "a number >= 0 (0: no decay)"),
    "momentum": (lambda v: 0 <= v < 1, "a number from 0 to below 1 (0: none)"),
    "dampening": (lambda v: 0 <= v <= 1, "a number between 0 and 1"),
}


def norm_sites(norm: DictConfig) -> dict[str, dict]:
    """norm.sites: for a site kind (attention, mlp, final: model.gpt.SITE_KINDS), the settings of norm.layer that
    differ there (DyT's alpha_init per site kind); {} for a norm without them."""
    sites = norm.get("sites")
    if not sites:
        return {}
    if not isinstance(sites, DictConfig) or any(not isinstance(v, DictConfig) for v in sites.values()):
        raise ConfigError("norm.sites must map a site kind (attention, mlp, final) to settings of norm.layer, "
                          "e.g. {attention: {alpha_init: 0.8}}")
    return {str(kind): OmegaConf.to_container(settings, resolve=True) for kind, settings in sites.items()}


@functools.cache
def built_in_norms() -> dict[str, str]:
    """normlab's own norms (conf/norm/*.yaml): name -> the class its layer names (a variant's: the norm its defaults
    list extends)."""
    found = {}
    for path in sorted((CONF_DIR / "norm").glob("*.yaml")):
        node = OmegaConf.load(path)
        while "_target_" not in (node.get("layer") or {}) and node.get("defaults"):
            node = OmegaConf.load(CONF_DIR / "norm" / f"{node.defaults[0]}.yaml")
        found[path.stem] = str((node.get("layer") or {}).get("_target_"))
    return found


def check_norm_config(norm: DictConfig) -> None:
    """The norm's yaml gives a name, and a layer with a `_target_`; a built-in's name only for the built-in's class
    (a run, its figures and its report group go by the name)."""
    name = norm.get("name") if "name" in norm and not OmegaConf.is_missing(norm, "name") else None
    if not isinstance(name, str) or not name.strip():
        raise ConfigError("the norm has no name (norm.name): give your norm's yaml a `name:`, the name its runs, "
                          "figures and report go by (docs/norms.md)")
    layer = norm.get("layer")
    if not isinstance(layer, DictConfig) or "_target_" not in layer:
        raise ConfigError(f"norm '{name}' has no norm.layer._target_: give the class of its layer (docs/norms.md)")
    own = built_in_norms().get(name)
    if own is not None and own != str(layer._target_):
        raise ConfigError(f"norm.name={name} is normlab's own norm (its class {own}), and this norm's class is "
                          f"{layer._target_}: give your norm a name of its own")


def check_norm(norm: DictConfig, width: int) -> None:
    """A norm's contract (model.norms), before anything is written: its config (check_norm_config), its class
    importable, built at the model's width as cls(width, **settings) at every site, its output of its input's shape
    and finite. One line naming the class, its file and what to change."""
    from normlab.model.norms import contract_violation, norm_class, source_of

    check_norm_config(norm)
    target = str(norm.layer._target_)
    try:
        cls = norm_class(target)
    except ValueError as e:
        raise ConfigError(f"norm '{norm.name}': its class {target} cannot be imported: {e}") from None
    settings = {k: v for k, v in OmegaConf.to_container(norm.layer, resolve=True).items() if k not in SPECIAL_KEYS}
    arguments = {"norm.layer": settings, **{f"norm.sites.{kind}": {**settings, **given}
                                           for kind, given in norm_sites(norm).items()}}
    if problem := contract_violation(cls, arguments, width):
        raise ConfigError(f"norm '{norm.name}': {target} ({source_of(cls)}): {problem}")


PRIMARY_CONTRASTS = ("centring", "bias", "interaction")  # the effects of the centring x bias 2x2


def check_analysis(analysis) -> None:
    """analysis (conf/train.yaml): the report's primary contrast and how many validations make a final loss."""
    unknown_keys("analysis", analysis, {"primary", "final_validations"})
    primary = analysis.get("primary")
    if primary is not None and primary not in PRIMARY_CONTRASTS:
        raise ConfigError(f"analysis.primary={shown(primary)}: give {one_of(list(PRIMARY_CONTRASTS))}, or null")
    positive_int("analysis.final_validations", analysis.get("final_validations", 1))


def check_optimizer(optimizer: DictConfig) -> None:
    lr = optimizer.get("lr")
    if not is_number(lr) or not lr >= 0:  # 0: the weights stay put (a check of a branch's start)
        raise ConfigError(f"optimizer.lr={lr}: give a learning rate >= 0")
    values = check_arguments("optimizer", optimizer)
    for key, (in_range, what) in OPTIMIZER_RANGES.items():
        value = values.get(key)
        if is_number(value) and not in_range(value):
            raise ConfigError(f"optimizer.{key}={value}: give {what}")
    betas = values.get("betas")
    if "betas" in values and not (isinstance(betas, list) and len(betas) == 2
                                  and all(is_number(b) and 0 <= b < 1 for b in betas)):
        raise ConfigError(f"optimizer.betas={shown(betas)}: give two numbers from 0 to below 1, e.g. [0.9, 0.95]")


# normlab's weights and optimizer state are float32, or float64 for checks of exactness (a branch's control arm)
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "64-true")
SHORT_PRECISIONS = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}  # Lightning's short names


def check_precision(trainer: DictConfig) -> None:
    precision = trainer.precision
    if precision not in PRECISIONS:
        full = SHORT_PRECISIONS.get(str(precision))
        raise ConfigError(f"trainer.precision={shown(precision)}: give " + (
            f"{full} (the same, written out)" if full else f"one of {', '.join(PRECISIONS)} (float32 weights, "
                                                           "with bf16 or fp16 autocast for the mixed ones; float64)"))
    algorithm = trainer.get("gradient_clip_algorithm")
    if algorithm not in (None, "norm", "value"):
        raise ConfigError(f"trainer.gradient_clip_algorithm={algorithm}: give norm, value or null (norm)")
    if precision == "16-mixed" and sharded(trainer.strategy):
        raise ConfigError(f"trainer.precision=16-mixed with the sharded trainer.strategy {trainer.strategy._target_}: "
                          "the gradient scaler checks each shard's gradients alone; use bf16-mixed, or strategy=ddp")


def sharded(strategy) -> bool:
    """Whether trainer.strategy is an object of a sharding strategy (FSDP, or Lightning's ModelParallelStrategy)."""
    if not isinstance(strategy, DictConfig) or "_target_" not in strategy:
        return False
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    target = get_object(strategy._target_)
    return isinstance(target, type) and issubclass(target, (FSDPStrategy, ModelParallelStrategy))


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


def model_settings(model: DictConfig) -> dict:
    """GPTConfig's arguments in a model preset: its keys but `name` (the preset's), each a field of GPTConfig; any
    other key is refused."""
    from normlab.model.gpt import GPTConfig

    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown_keys("model", model, {"name", *fields})
    return {k: v for k, v in model.items() if k != "name"}


def check_checkpoints(cfg: DictConfig) -> None:
    """`checkpoints` configures the run directory, which no run goes without: it cannot be removed, and takes
    CheckpointSchedule's settings (those train() does not fill in from run_dir and trainer), of their types."""
    from normlab.training.rundir.checkpoints import CheckpointSchedule

    if not isinstance(cfg.get("checkpoints"), DictConfig):
        raise ConfigError("checkpoints cannot be removed: it configures the run directory (its checkpoints, "
                          "resuming); set checkpoints.every, dense_until, sparse_every or scheduled instead")
    if "scheduled_checkpoints" in (cfg.get("callbacks") or {}):  # a config file of before the move (common/moved.py)
        raise ConfigError("callbacks.scheduled_checkpoints is now checkpoints (every, dense_until, sparse_every, "
                          "scheduled): rename it in your config file")
    filled_in = ("folder", "max_steps", "val_check_interval")
    parameters = {k: p for k, p in signature(CheckpointSchedule).parameters.items() if k not in filled_in}
    unknown_keys("checkpoints", cfg.checkpoints, set(parameters))
    if missing := [k for k, p in parameters.items() if p.default is p.empty and k not in cfg.checkpoints]:
        raise ConfigError(f"checkpoints.{missing[0]} is missing: give a number of steps")
    for key, value in OmegaConf.to_container(cfg.checkpoints, resolve=True).items():
        check_type(f"checkpoints.{key}", value, parameters[key])


def check_slurm_tasks(devices) -> None:
    """Under a Slurm batch job, one task per device: Lightning starts no processes of its own there."""
    tasks = os.environ.get("SLURM_NTASKS_PER_NODE")
    interactive = os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive")
    if tasks and not interactive and str(devices) != tasks.split("(")[0]:
        raise ConfigError(f"Slurm runs {tasks} tasks per node but trainer.devices={devices}: set --ntasks-per-node "
                          "equal to the devices per node (one task per GPU)")


def check_run_dir_place(run_dir: Path) -> None:
    """A run directory is neither a prepared corpus nor inside one, nor inside another run's directory (whose
    files a run would mix with its own; common/outputs.py tells what a folder is)."""
    if what_is(run_dir) == "a prepared corpus":
        raise ConfigError(f"run_dir={run_dir} is a prepared corpus: give a run directory of its own, e.g. "
                          "run_dir=checkpoints/myrun")
    if found := enclosing(run_dir):
        raise ConfigError(f"run_dir={run_dir} lies inside {found[1]}, {found[0]}: give a run directory outside it")


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_runtime(runtime: DictConfig) -> None:
    if runtime.get("compile") not in (False, True, "blocks", "model"):
        raise ConfigError(f"runtime.compile={runtime.compile}: give false, blocks (each transformer block), model (the "
                          "whole model, loss included; the blocks under strategy=fsdp) or true (blocks)")
    if runtime.get("compile_mode", "default") not in COMPILE_MODES:
        raise ConfigError(f"runtime.compile_mode={runtime.compile_mode}: give one of {', '.join(COMPILE_MODES)} "
                          "(torch.compile's modes; reduce-overhead replays CUDA graphs)")
    for key in ("loss_chunk", "head_rows_multiple"):
        positive_int(f"runtime.{key}", runtime.get(key, 1))


def check_train_config(cfg: DictConfig) -> None:
    check_norm_config(cfg.norm)  # first: the run's name interpolates norm.name
    if not str(cfg.run_dir).strip():
        raise ConfigError("run_dir is empty: give the run's directory, e.g. run_dir=checkpoints/myrun")
    check_run_dir_place(Path(str(cfg.run_dir)))
    check_checkpoints(cfg)  # first: the angles callback interpolates them
    if not is_int(cfg.seed) or not 0 <= cfg.seed < 2**32:
        raise ConfigError(f"seed={cfg.seed}: give a whole number from 0 to 2**32 - 1")
    finite("", OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True))
    if cfg.global_batch_size is not None:
        positive_int("global_batch_size", cfg.global_batch_size)
    fraction("schedule.warmup_fraction", cfg.schedule.warmup_fraction)
    fraction("schedule.min_lr_ratio", cfg.schedule.min_lr_ratio)
    check_analysis(cfg.get("analysis") or {})
    check_runtime(cfg.runtime)
    mode = cfg.runtime.get("compile_mode", "default")
    if mode != "default" and not cfg.runtime.compile:
        raise ConfigError(f"runtime.compile_mode={mode} with runtime.compile=false compiles nothing: set "
                          "runtime.compile=model (or blocks), or leave compile_mode at default")
    if mode in ("reduce-overhead", "max-autotune") and sharded(cfg.trainer.strategy):  # the modes with CUDA graphs
        raise ConfigError(f"runtime.compile_mode={mode} replays CUDA graphs, which cannot hold the sharded strategy's "
                          "gathers and reduce-scatters: use default or max-autotune-no-cudagraphs with strategy=fsdp")
    check_optimizer(cfg.optimizer)
    for key in ("max_steps", "val_check_interval", "num_nodes", "log_every_n_steps"):
        positive_int(f"trainer.{key}", cfg.trainer.get(key))
    clip = cfg.trainer.get("gradient_clip_val")
    if clip is not None and (not isinstance(clip, (int, float)) or isinstance(clip, bool) or clip < 0):
        raise ConfigError(f"trainer.gradient_clip_val={clip}: give a number >= 0 (0 or null: no clipping)")
    if cfg.trainer.get("deterministic") not in (None, True, False, "warn"):
        raise ConfigError(f"trainer.deterministic={cfg.trainer.deterministic}: give true (torch's deterministic "
                          "algorithms), warn (only warn where an operation has none), false or null")
    check_precision(cfg.trainer)
    check_slurm_tasks(cfg.trainer.devices)
    if str(cfg.trainer.strategy).startswith("fsdp"):
        raise ConfigError(f"trainer.strategy={cfg.trainer.strategy} would shard the whole model as one unit: use "
                          "strategy=fsdp (one transformer block per unit; normlab/training/strategies.py)")
    if str(cfg.trainer.accelerator) in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"trainer.accelerator={cfg.trainer.accelerator} but this machine has no GPU that torch "
                              "can use: train on the CPU here (trainer=default, or trainer.accelerator=cpu)")
    width = model_settings(cfg.model).get("n_embd", 8)
    norms = {"norm.layer": cfg.norm.layer}
    for kind, settings in norm_sites(cfg.norm).items():
        norms[f"norm.sites.{kind}"] = OmegaConf.merge(OmegaConf.to_container(cfg.norm.layer, resolve=True), settings)
    for name, node in norms.items():
        if "_target_" in node:
            check_arguments(name, node)
    check_norm(cfg.norm, width)  # before the objects that import Lightning
    objects = {"data": cfg.data, "trainer": cfg.trainer}
    if isinstance(cfg.trainer.strategy, DictConfig):
        objects["trainer.strategy"] = cfg.trainer.strategy
    objects.update({f"callbacks.{k}": v for k, v in (cfg.get("callbacks") or {}).items()})
    objects.update({f"logger.{k}": v for k, v in cfg.logger.items()})
    for name, node in objects.items():
        if node is not None and "_target_" in node:
            check_arguments(name, node)
