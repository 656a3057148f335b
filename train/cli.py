"""Entry points: normlab-train, normlab-prepare, normlab-describe (Hydra apps over conf/).

The data path: conf -> train() -> data module, model, callbacks, loggers -> Lightning Trainer.
"""

import dataclasses
import errno
import os
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.plugins.environments import SLURMEnvironment
from omegaconf import DictConfig, OmegaConf

from train import runtime
from train.checkpoint_io import FsyncCheckpointIO
from train.errors import ConfigError, NormlabError
from train.model import GPT, GPTConfig
from train.module import LanguageModel
from train.paths import CONF_DIR


def fail(message: str):
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    sys.exit(2)


def check_group_choices(args: list[str]) -> None:
    """Reject an unknown option of a config group (model=7m, norm=batchnorm) in one line that lists
    the valid ones, before Hydra composes anything."""
    parser = OverridesParser.create()
    for arg in args:
        try:
            (override,) = parser.parse_overrides([arg])
        except Exception:  # flags such as -m or --cfg, and their values: Hydra reports real errors itself
            continue
        group = CONF_DIR / override.key_or_group
        if override.is_delete() or not group.is_dir() or override.key_or_group.startswith("hydra/"):  # Hydra's own
            continue
        choices = override.sweep_string_iterator() if override.is_sweep_override() else [override.get_value_element_as_str()]
        valid = sorted(p.stem for p in group.glob("*.yaml") if not p.stem.startswith("_"))  # _x: shared parts
        for choice in choices:
            if choice not in valid and choice != "null":
                fail(f"unknown {override.key_or_group} '{choice}': choose one of {', '.join(valid)} (conf/{override.key_or_group}/)")


class WritableOutputDir(Callback):
    """A Hydra callback: check that the run's (or the sweep's) output directory can be written before Hydra
    creates it, so that an unwritable one is a one-line error rather than a traceback."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self.check(Path(config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.check(Path(config.hydra.sweep.dir))

    @staticmethod
    def check(directory: Path) -> None:
        existing = next(p for p in [directory, *directory.parents] if p.exists())
        try:
            if not existing.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(existing))
            tempfile.TemporaryFile(dir=existing).close()
        except OSError as e:
            fail(f"cannot write the output directory {directory} ({existing}: {e.strerror}): "
                 "give a writable run_dir= (or paths.output_dir=)")


def hydra_app(config_name: str):
    """Turn `task(cfg)` into a console-script entry point over conf/<config_name>.yaml."""

    def decorate(task):
        @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)
        def run(cfg: DictConfig):
            try:
                return task(cfg)
            except NormlabError as e:
                fail(str(e))

        def main():
            check_group_choices(sys.argv[1:])
            run()

        main.__doc__ = task.__doc__
        return main

    return decorate


def build(config: DictConfig):
    """hydra.utils.instantiate, letting normlab's own errors through unwrapped (Hydra wraps what a constructor
    raises in an InstantiationException)."""
    try:
        return instantiate(config)
    except InstantiationException as e:
        if isinstance(e.__cause__, NormlabError):
            raise e.__cause__ from None
        raise


def build_model(cfg: DictConfig) -> GPT:
    """The GPT of `cfg.model` with the norm layer of `cfg.norm` (weights not initialised)."""
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    model = GPT(GPTConfig(**{k: v for k, v in cfg.model.items() if k in fields}), norm=instantiate(cfg.norm.layer))
    model.activation_checkpointing = cfg.get("activation_checkpointing", False)
    return model


def gradient_accumulation(cfg: DictConfig) -> int:
    """Micro-batches per optimizer step, so that every step sees global_batch_size sequences whatever the
    number of devices and nodes (None: one micro-batch per device and step)."""
    devices, nodes, micro = cfg.trainer.devices, cfg.trainer.num_nodes, cfg.data.batch_size
    tasks = os.environ.get("SLURM_NTASKS_PER_NODE")
    if tasks and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive") and str(devices) != tasks.split("(")[0]:
        raise ConfigError(f"Slurm runs {tasks} tasks per node but trainer.devices={devices}: set --ntasks-per-node "
                          "equal to the devices per node (one task per GPU)")
    if cfg.get("global_batch_size") is None:
        return 1
    if not isinstance(devices, int) or devices < 1:
        raise ConfigError(f"trainer.devices={devices}: give a number of devices when global_batch_size is set")
    accumulate, remainder = divmod(cfg.global_batch_size, micro * devices * nodes)
    if remainder or accumulate < 1:
        raise ConfigError(f"global_batch_size={cfg.global_batch_size} is not a multiple of data.batch_size={micro} x "
                          f"trainer.devices={devices} x trainer.num_nodes={nodes}: choose values whose product divides it")
    return accumulate


def build_module(cfg: DictConfig) -> LanguageModel:
    model = build_model(cfg)
    model.init_weights(cfg.seed)
    if cfg.runtime.compile:
        for block in model.blocks:
            block.compile()  # in place: parameter names, hence checkpoints, stay those of the eager model
    max_steps = cfg.trainer.max_steps
    if max_steps is None or max_steps < 1:
        raise ConfigError(f"trainer.max_steps must be a positive number of optimizer steps, got {max_steps}")
    return LanguageModel(
        model,
        optimizer=instantiate(cfg.optimizer),
        warmup_steps=max(1, round(cfg.schedule.warmup_fraction * max_steps)),
        max_steps=max_steps,
        min_lr_ratio=cfg.schedule.min_lr_ratio,
        seed=cfg.seed,
        config={k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != "logger"},
    )


def build_trainer(cfg: DictConfig, callbacks: list, accumulate: int) -> L.Trainer:
    loggers = [instantiate(c) for c in cfg.logger.values()]
    # One preemption mechanism per launch path: under sbatch, the SlurmRequeue callback (SIGUSR1); under Hydra's
    # submitit launcher, submitit. Lightning's own Slurm requeue is off in both.
    plugins = [FsyncCheckpointIO(), *([SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else [])]
    return instantiate(cfg.trainer, callbacks=callbacks, logger=loggers, accumulate_grad_batches=accumulate, plugins=plugins,
                       val_check_interval=cfg.trainer.val_check_interval * accumulate)  # Lightning counts micro-batches


def resume_checkpoint(run_dir: Path) -> str | None:
    """The newest complete checkpoint of the run: last.ckpt, else the newest scheduled one after step 0. A checkpoint whose
    zip archive is unreadable (a save cut short) is skipped with a warning in favour of the previous one; the
    temporary file of a save that was killed is removed."""
    for partial in (run_dir / "checkpoints").glob(".*.ckpt.tmp"):
        print(f"warning: removing {partial}, left by a save that was cut short", file=sys.stderr)
        partial.unlink(missing_ok=True)  # every DDP rank looks
    for path in sorted((run_dir / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True):
        if path.name.startswith("nonfinite") or path.name == "step-0000000.ckpt":  # step 0: a fresh start is the same
            continue
        try:
            zipfile.ZipFile(path).close()  # torch checkpoints are zip archives: a truncated one fails here
            return str(path)
        except (zipfile.BadZipFile, OSError):
            print(f"warning: {path} is unreadable (a save cut short?): skipped", file=sys.stderr)
    return None


def flat(config, prefix: str = "") -> dict:
    items = {}
    for key, value in config.items():
        if isinstance(value, dict):
            items.update(flat(value, f"{prefix}{key}."))
        else:
            items[f"{prefix}{key}"] = value
    return items


def check_run_dir(cfg: DictConfig, run_dir: Path) -> None:
    """Refuse a run directory holding checkpoints of another config, unless restart=true (see move_aside)."""
    if cfg.restart or not any((run_dir / "checkpoints").glob("*.ckpt")):
        return
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"{run_dir} holds checkpoints but no config.yaml to check them against: give another "
                          "run_dir, or restart=true to move that run aside and start over")
    # what only names or locates things may change; everything that shapes the training may not
    ignored = ("logger.", "restart", "paths.", "experiment_name", "run_name", "data.dir", "probe.dir", "callbacks.angles.probe_dir")
    old, new = (flat(OmegaConf.to_container(c, resolve=True)) for c in (OmegaConf.load(saved), cfg))
    # a run directory that was moved keeps its identity: paths inside it follow it
    old = {k: v.replace(old["run_dir"], new["run_dir"]) if isinstance(v, str) else v for k, v in old.items()}
    changed = [k for k in sorted(old.keys() | new.keys(), key=lambda k: (k.startswith("callbacks."), k))  # callbacks
               if not k.startswith(ignored) and old.get(k) != new.get(k)]  # last: mostly copies of trainer settings
    if changed:
        shown = ", ".join(f"{k}: {old.get(k)} -> {new.get(k)}" for k in changed[:3]) + (" ..." if len(changed) > 3 else "")
        raise ConfigError(f"{run_dir} holds checkpoints of another config ({shown}): give another run_dir, "
                          "or restart=true to move that run aside and start over")


def move_aside(run_dir: Path) -> None:
    """restart=true: move an earlier run to <run_dir>.replaced-<time> (nothing is deleted); the new run gets a
    new wandb id (paths.run_id)."""
    if run_dir.is_dir() and any(run_dir.iterdir()):
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(aside)
        print(f"restart=true: moved the earlier run to {aside}", file=sys.stderr)


@hydra_app("train")
def train(cfg: DictConfig) -> None:
    """Train one model; resumes from the newest complete checkpoint of its run directory when there is one."""
    run_dir = Path(cfg.run_dir)
    try:
        attention = runtime.apply(cfg.runtime, cfg.trainer.devices if isinstance(cfg.trainer.devices, int) else 1)
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        accumulate = gradient_accumulation(cfg)
        module = build_module(cfg)
        datamodule = build(cfg.data)
        datamodule.verify()
        callbacks = [build(c) for c in cfg.callbacks.values()]  # loads and checks the angle probe set
        check_run_dir(cfg, run_dir)
    except NormlabError:
        if run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()  # Hydra made it for this run: leave nothing behind
        raise
    if cfg.restart:
        move_aside(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    OmegaConf.save(OmegaConf.create(list(HydraConfig.get().overrides.task)), run_dir / "overrides.yaml")

    trainer = build_trainer(cfg, callbacks, accumulate)
    try:
        with attention:
            trainer.fit(module, datamodule=datamodule, ckpt_path=resume_checkpoint(run_dir))
    finally:
        if "wandb" in cfg.logger:
            import wandb

            wandb.finish()  # one wandb run per Hydra job, also in -m sweeps


@hydra_app("prepare")
def prepare(cfg: DictConfig) -> None:
    """Tokenize the corpus of `data=` into data/<name>/."""
    from train.prepare import prepare as prepare_data

    prepare_data(cfg.data, num_proc=cfg.num_proc, ranks_file=cfg.tokenizer_ranks_file)


@hydra_app("describe")
def describe(cfg: DictConfig) -> None:
    """Parameter counts and training FLOPs per token of `model=` with `norm=`, on the meta device."""
    with torch.device("meta"):
        model = build_model(cfg)
    c = model.config
    rows = [
        ("model", f"{cfg.model.name} ({c.n_layer} layers, d={c.n_embd}, {c.n_head} heads, context {c.block_size})"),
        ("norm", cfg.norm.name),
        ("embeddings", "tied" if c.tie_embeddings else "untied"),
        ("parameters", f"{model.num_params():,}"),
        ("non-embedding parameters", f"{model.num_params(non_embedding=True):,}"),
        ("training FLOPs per token", f"{model.flops_per_token():,}  (6 N_matmul + 12 L T d)"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
