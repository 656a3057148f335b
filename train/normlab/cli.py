"""Entry points: normlab-train, normlab-prepare, normlab-describe (Hydra apps over conf/).

The data path: conf -> fit(cfg) -> data module, model, callbacks, loggers -> Lightning Trainer. Torch and Lightning
are imported where they are used, so that a bad command line is answered in a second.
"""

import dataclasses
import errno
import itertools
import os
import sys
import tempfile
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import InstantiationException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from normlab.errors import ConfigError, Interrupted, NormlabError, install_signal_handlers, process_rank, received
from normlab.paths import CONF_DIR


def fail(message: str, code: int = 2):
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    sys.exit(code)


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
        choices = (
            override.sweep_string_iterator() if override.is_sweep_override() else [override.get_value_element_as_str()]
        )
        valid = sorted(p.stem for p in group.glob("*.yaml") if not p.stem.startswith("_"))  # _x: shared parts
        for choice in choices:
            if choice not in valid and choice != "null":
                fail(
                    f"unknown {override.key_or_group} '{choice}': choose one of {', '.join(valid)} "
                    f"(conf/{override.key_or_group}/)"
                )


class WritableOutputDir(Callback):
    """A Hydra callback: check that the run's (or the sweep's) output directory can be written before Hydra
    creates it, so that an unwritable one is a one-line error rather than a traceback."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self.check(Path(config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.check(Path(config.hydra.sweep.dir))

    @staticmethod
    def check(directory: Path) -> None:
        if not str(directory).strip():
            fail("run_dir is empty: give the run's directory, e.g. run_dir=checkpoints/myrun")
        existing = next(p for p in [directory, *directory.parents] if p.exists())
        try:
            if not existing.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(existing))
            tempfile.TemporaryFile(dir=existing).close()
        except OSError as e:
            fail(
                f"cannot write the output directory {directory} ({existing}: {e.strerror}): "
                "give a writable run_dir= (or paths.output_dir=)"
            )


def jobs_not_run() -> str:
    """'; jobs not run: ...' for a -m sweep stopped in its current job: the jobs after it, in the order Hydra's basic
    sweeper runs them (the product of the swept values, sweeper params first), each by its swept values."""
    config = HydraConfig.get()
    if config.mode != RunMode.MULTIRUN:
        return ""
    params = [f"{k}={v}" for k, v in (config.sweeper.get("params") or {}).items()]
    values: dict[str, list[str]] = {}
    for arg in params + [a for a in sys.argv[1:] if not a.startswith("-")]:
        try:
            (override,) = OverridesParser.create().parse_overrides([arg])
        except Exception:
            continue
        key = override.get_key_element()
        values[key] = list(override.sweep_string_iterator()) if override.is_sweep_override() else [None]
    swept = {k: v for k, v in values.items() if len(v) > 1}
    jobs = [" ".join(f"{k}={v}" for k, v in zip(swept, job)) for job in itertools.product(*swept.values())]
    later = jobs[config.job.num + 1 :]
    return (
        f"; jobs not run: {', '.join(later)} (run the same command again: finished runs are skipped)" if later else ""
    )


def hydra_app(config_name: str):
    """Turn `task(cfg)` into a console-script entry point over conf/<config_name>.yaml."""

    def decorate(task):
        @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)
        def run(cfg: DictConfig):
            try:
                return task(cfg)
            except NormlabError as e:
                if isinstance(e, Interrupted) and process_rank():
                    sys.exit(e.exit_code)  # rank 0 says it
                fail(f"{e}{jobs_not_run()}", e.exit_code)

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
        raise ConfigError(f"cannot build {config.get('_target_')}: {str(e.__cause__ or e).splitlines()[0]}") from None


def build_model(cfg: DictConfig):
    """The GPT of `cfg.model` with the norm layer of `cfg.norm` (weights not initialised)."""
    from normlab.model import GPT, GPTConfig

    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    model = GPT(GPTConfig(**{k: v for k, v in cfg.model.items() if k in fields}), norm=instantiate(cfg.norm.layer))
    model.activation_checkpointing = cfg.get("activation_checkpointing", False)
    return model


def gradient_accumulation(cfg: DictConfig) -> int:
    """Micro-batches per optimizer step, so that every step sees global_batch_size sequences whatever the
    number of devices and nodes (None: one micro-batch per device and step)."""
    devices, nodes, micro = cfg.trainer.devices, cfg.trainer.num_nodes, cfg.data.batch_size
    tasks = os.environ.get("SLURM_NTASKS_PER_NODE")
    if (
        tasks
        and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")
        and str(devices) != tasks.split("(")[0]
    ):
        raise ConfigError(
            f"Slurm runs {tasks} tasks per node but trainer.devices={devices}: set --ntasks-per-node "
            "equal to the devices per node (one task per GPU)"
        )
    if cfg.get("global_batch_size") is None:
        return 1
    if not isinstance(devices, int) or devices < 1:
        raise ConfigError(f"trainer.devices={devices}: give a number of devices when global_batch_size is set")
    accumulate, remainder = divmod(cfg.global_batch_size, micro * devices * nodes)
    if remainder or accumulate < 1:
        raise ConfigError(
            f"global_batch_size={cfg.global_batch_size} is not a multiple of data.batch_size={micro} x "
            f"trainer.devices={devices} x trainer.num_nodes={nodes}: choose values whose product divides it"
        )
    return accumulate


def build_module(cfg: DictConfig):
    from normlab.module import LanguageModel

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
        seed=cfg.seed,  # the run's config (but the loggers', which name the run) rides in every checkpoint
        config=OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "logger"]), resolve=True),
    )


def build_trainer(cfg: DictConfig, callbacks: list, accumulate: int):
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from normlab.run_dir import RunDirectory

    loggers = [instantiate(c) for c in cfg.logger.values()]
    run = next((c for c in callbacks if isinstance(c, RunDirectory)), None)
    # One preemption mechanism per launch path: under sbatch, the Preemption callback (SIGUSR1); under Hydra's
    # submitit launcher, submitit. Lightning's own Slurm requeue is off in both.
    plugins = [
        *([run.io] if run else []),
        *([SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []),
    ]
    return instantiate(
        cfg.trainer,
        callbacks=callbacks,
        logger=loggers,
        accumulate_grad_batches=accumulate,
        plugins=plugins,
        val_check_interval=cfg.trainer.val_check_interval * accumulate,
    )  # Lightning counts micro-batches


def fit(cfg: DictConfig, extra_callbacks=()):
    """Train the run of `cfg` (resuming it when its directory holds one) and return its LightningModule: what
    normlab-train does, as a plain function (the benchmark calls it too)."""
    from normlab.checks import check_train_config

    run_dir = Path(cfg.run_dir)
    try:
        if received:  # a stop signal before this run (of a sweep) started
            raise Interrupted("stopped by a signal before this run started", received[0])
        check_train_config(cfg)
        import lightning as L

        from normlab import runtime
        from normlab.run_dir import RunDirectory

        attention = runtime.apply(cfg.runtime, cfg.trainer.devices if isinstance(cfg.trainer.devices, int) else 1)
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        accumulate = gradient_accumulation(cfg)
        module = build_module(cfg)
        datamodule = build(cfg.data)
        datamodule.verify()
        devices = cfg.trainer.devices if isinstance(cfg.trainer.devices, int) else 1
        datamodule.check_global_batch(cfg.data.batch_size * devices * cfg.trainer.num_nodes * accumulate)
        callbacks = [build(c) for c in cfg.callbacks.values()]  # loads and checks the angle probe set
        run = next((c for c in callbacks if isinstance(c, RunDirectory)), None)
        if run is None:
            raise ConfigError(
                "callbacks.scheduled_checkpoints (the run directory: checkpoints, resume) cannot be removed"
            )
    except NormlabError:
        if run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()  # Hydra made it for this run: leave nothing behind
        raise
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    with run.opened(cfg, overrides):
        if run.resume_step >= cfg.trainer.max_steps:
            print(f"{run_dir} is finished (step {run.resume_step} of {cfg.trainer.max_steps}): nothing to do")
            return module
        trainer = build_trainer(cfg, [*callbacks, *extra_callbacks], accumulate)
        failed = True
        try:
            with attention:
                trainer.fit(module, datamodule=datamodule, ckpt_path=run.resume_path)
            failed = False
        finally:
            if "wandb" in cfg.logger:
                import wandb

                wandb.finish(exit_code=int(failed))  # one wandb run per Hydra job, also in -m sweeps
    return module


@hydra_app("train")
def train(cfg: DictConfig) -> None:
    """Train one model; resumes from the newest intact checkpoint of its run directory when there is one."""
    install_signal_handlers()  # from here on, SIGTERM and SIGUSR1 stop the run (or the sweep) with its progress saved
    fit(cfg)


@hydra_app("prepare")
def prepare(cfg: DictConfig) -> None:
    """Tokenize the corpus of `data=` into data/<name>/."""
    from normlab.prepare import prepare as prepare_data

    prepare_data(cfg.data, num_proc=cfg.num_proc, ranks_file=cfg.tokenizer_ranks_file)


@hydra_app("describe")
def describe(cfg: DictConfig) -> None:
    """Parameter counts and training FLOPs per token of `model=` with `norm=`, on the meta device."""
    import torch

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
