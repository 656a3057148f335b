"""What every entry point builds from a composed config: the model, the LightningModule, the data module, the run
directory, the callbacks and the Trainer, and `train(cfg)`, which trains a run with them (normlab-train is a thin
Hydra main over it; normlab-angles, the report, the benchmark and the tests build with the same functions). The data
path: conf -> train(cfg) -> data module, model, run directory, callbacks, loggers -> Lightning Trainer. Torch and
Lightning are imported where they are used, so that a bad command line is answered in a second."""

import sys
from functools import partial
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from normlab.common.errors import ConfigError, Interrupted, NormlabError, process_rank, received
from normlab.training.checks import check_norm, check_train_config, model_settings, norm_sites


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
    """The GPT of `cfg.model` with the norm layer of `cfg.norm` (weights not initialised); a key of cfg.model that is
    not GPTConfig's, and a norm that breaks a norm's contract (checks.check_norm), are refused in one line."""
    from normlab.model.gpt import GPT, GPTConfig

    settings = model_settings(cfg.model)
    check_norm(cfg.norm, settings.get("n_embd", 8))
    layer = instantiate(cfg.norm.layer)
    sites = {kind: partial(layer, **settings) for kind, settings in norm_sites(cfg.norm).items()}
    model = GPT(GPTConfig(**settings), norm=layer, sites=sites)
    if (cfg.get("branch") or {}).get("zero_mean_writers"):  # a branch's control arm
        from normlab.training.branch import centre_writes

        centre_writes(model)
    model.activation_checkpointing = cfg.get("activation_checkpointing", False)
    runtime = cfg.get("runtime") or {}  # a converted checkpoint's config has none: the model's defaults
    model.loss_chunk = runtime.get("loss_chunk", model.loss_chunk)
    model.head_rows_multiple = runtime.get("head_rows_multiple", model.head_rows_multiple)
    return model


def compile_scope(cfg: DictConfig) -> str | None:
    """What runtime.compile compiles: None, 'blocks' (each transformer block; true, as before 'model' existed) or
    'model' (embeddings, blocks, final norm, head and loss as one graph), which a sharded strategy narrows to the
    blocks (FSDP's units: the root's hooks gather its parameters outside any graph)."""
    from hydra.utils import get_class
    from lightning.pytorch.strategies import ModelParallelStrategy

    scope = {False: None, True: "blocks"}.get(cfg.runtime.compile, cfg.runtime.compile)
    strategy = cfg.trainer.get("strategy")
    if scope == "model" and isinstance(strategy, DictConfig) and issubclass(get_class(strategy._target_),
                                                                            ModelParallelStrategy):
        return "blocks"
    return scope


def gradient_accumulation(cfg: DictConfig) -> int:
    """Micro-batches per optimizer step, so that every step sees global_batch_size sequences whatever the
    number of devices and nodes (None: one micro-batch per device and step)."""
    devices, nodes, micro = cfg.trainer.devices, cfg.trainer.num_nodes, cfg.data.batch_size
    if not isinstance(micro, int):  # normlab-train, normlab-describe and the preflight resolve it (cluster/plan.py)
        raise ConfigError(f"data.batch_size={micro}: give a number of sequences per device and micro-batch, or auto "
                          "(with global_batch_size: the largest micro-batch the resource plan fits on the GPU)")
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
    from normlab.training.module import LanguageModel

    model = build_model(cfg)
    model.init_weights(cfg.seed)
    scope = compile_scope(cfg)  # in place: parameter names, hence checkpoints, stay those of the eager model
    mode = cfg.runtime.get("compile_mode", "default")
    for part in model.blocks if scope == "blocks" else [model] if scope == "model" else []:
        part.compile(mode=None if mode == "default" else mode)
    max_steps = cfg.trainer.max_steps
    return LanguageModel(
        model,
        optimizer=instantiate(cfg.optimizer),
        warmup_steps=max(1, round(cfg.schedule.warmup_fraction * max_steps)),
        max_steps=max_steps,
        min_lr_ratio=cfg.schedule.min_lr_ratio,
        seed=cfg.seed,  # the run's config (but the loggers', which name the run) rides in every checkpoint
        config=OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "logger"]), resolve=True),
    )


def build_run_directory(cfg: DictConfig):
    """The run directory of `cfg.run_dir`, with the checkpoint schedule of `cfg.checkpoints` (run_dir.RunDirectory)."""
    from normlab.training.rundir.directory import RunDirectory

    first_step = (cfg.get("branch") or {}).get("step") or 0  # a branch's (training/branch.py)
    return RunDirectory(cfg.run_dir, cfg.trainer.max_steps, cfg.trainer.val_check_interval, first_step,
                        **cfg.checkpoints)


def build_trainer(cfg: DictConfig, callbacks: list, accumulate: int, run=None):
    """The Trainer of `cfg` with `callbacks`, and the run directory `run` that train() built (it saves every
    checkpoint, through its own checkpoint IO); without one (the preflight) the Trainer writes no run directory."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from normlab.training.callbacks.progress import TrainingBar

    loggers = [instantiate(c) for c in cfg.logger.values()]
    # One preemption mechanism per launch path: under sbatch, the Preemption callback (SIGUSR1); under Hydra's
    # submitit launcher, submitit. Lightning's own Slurm requeue is off in both.
    plugins = [
        *([run.io] if run else []),
        *([SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []),
    ]
    callbacks = [*([run] if run else []), *callbacks]
    # The bar on a terminal; in a job's log, TokenThroughput's progress lines instead
    if bar := cfg.trainer.get("enable_progress_bar", sys.stdout.isatty()):
        callbacks = [*callbacks, TrainingBar(refresh_rate=cfg.trainer.log_every_n_steps)]  # its metrics: a wait
    from normlab.training.strategies import precision_settings

    precision, precision_plugins = precision_settings(cfg.trainer)
    plugins += precision_plugins
    return instantiate(
        cfg.trainer,
        callbacks=callbacks,
        logger=loggers,
        accumulate_grad_batches=accumulate,
        plugins=plugins,
        precision=precision,
        enable_progress_bar=bar,
        val_check_interval=cfg.trainer.val_check_interval * accumulate,
    )  # Lightning counts micro-batches


def summary(cfg: DictConfig, module, accumulate: int) -> str:
    """One line on what is trained: instead of Lightning's model table."""
    model, devices = module.model, cfg.trainer.devices if isinstance(cfg.trainer.devices, int) else 1
    config = model.config
    return (f"{cfg.run_name}: {model.num_params():,} parameters ({config.n_layer} layers, d={config.n_embd}, "
            f"{cfg.norm.name}), {model.flops_per_token() / 1e6:,.0f} MFLOPs/token; {cfg.trainer.max_steps:,} steps of "
            f"{cfg.data.batch_size} x {devices} x {cfg.trainer.num_nodes} x {accumulate} sequences "
            f"(micro-batch x devices x nodes x accumulation); {cfg.trainer.precision}; run directory {cfg.run_dir}")


def build_callbacks(cfg: DictConfig) -> list:
    """The callbacks of `cfg.callbacks`; one set to null is off, as one removed (`~callbacks.angles`)."""
    return [build(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]


def train(cfg: DictConfig, extra_callbacks=(), micro_batch=None):
    """Train the run of `cfg` (resuming it when its directory holds one) and return its LightningModule.
    micro_batch(cfg, model on the meta device): resolves data.batch_size=auto into cfg and says how (normlab-train
    passes the resource plan's); without it, auto is refused."""
    run_dir = Path(cfg.run_dir)
    try:
        if received:  # a stop signal before this run (of a sweep) started
            raise Interrupted("stopped by a signal before this run started", received[0])
        if cfg.data.batch_size == "auto" and micro_batch:  # before it is checked and saved: the number it chose
            import torch

            with torch.device("meta"):
                chosen = micro_batch(cfg, build_model(cfg))
            if not process_rank():
                print(chosen, flush=True)
        check_train_config(cfg)
        if (cfg.get("branch") or {}).get("source") is not None:  # recorded absolute: a report from anywhere finds it
            cfg.branch.source = str(Path(str(cfg.branch.source)).resolve())
        import lightning as L

        from normlab.training import runtime
        from normlab.training.console import quiet_libraries

        quiet_libraries()
        from normlab.training.branch import check_branch, start_checkpoint
        from normlab.training.rundir.revalidate import revalidate

        attention = runtime.apply(cfg.runtime, cfg.trainer.devices if isinstance(cfg.trainer.devices, int) else 1)
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        accumulate = gradient_accumulation(cfg)
        module = build_module(cfg)
        datamodule = build(cfg.data)
        datamodule.verify()
        devices = cfg.trainer.devices if isinstance(cfg.trainer.devices, int) else 1
        datamodule.check_global_batch(cfg.data.batch_size * devices * cfg.trainer.num_nodes * accumulate)
        run = build_run_directory(cfg)
        # a branch's first checkpoint, from its source's read once and verified, before anything is written (by rank
        # 0, which writes it; the other ranks resume from it); None for any other run, and for a branch that resumes
        # from its own checkpoints (its source may since have moved)
        branching = process_rank() == 0 and (cfg.restart or not run.holds_checkpoints())
        source = check_branch(cfg) if branching else None
        start = start_checkpoint(cfg, module, source) if source else None
        del source  # the source's checkpoint, in memory: only the start is kept
        callbacks = build_callbacks(cfg)  # loads and checks the angle probe set
    except NormlabError:
        if run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()  # Hydra made it for this run: leave nothing behind
        raise
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    with run.opened(cfg, overrides, start):
        if run.resume_step >= cfg.trainer.max_steps:
            with attention:
                revalidate(cfg, run, module, datamodule)
            print(f"{run_dir} is finished (step {run.resume_step} of {cfg.trainer.max_steps}): nothing to do")
            return module
        trainer = build_trainer(cfg, [*callbacks, *extra_callbacks], accumulate, run)
        if not process_rank():
            print(summary(cfg, module, accumulate), flush=True)
        failed = True
        try:
            with attention:
                revalidate(cfg, run, module, datamodule)  # rank 0, while the others wait for it to join
                trainer.fit(module, datamodule=datamodule, ckpt_path=run.resume_path)
            failed = False
        finally:
            if "wandb" in cfg.logger:
                import wandb

                wandb.finish(exit_code=int(failed))  # one wandb run per Hydra job, also in -m sweeps
    return module
