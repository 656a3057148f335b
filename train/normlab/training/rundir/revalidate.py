"""Validation rows that metrics.csv lost (a row torn by a kill, a damaged copy of the file) regenerated from a
checkpoint of their step: when a run resumes, or is found finished, rank 0 validates that checkpoint's weights again
as training did (the run's own LightningModule and validation data, its accelerator and precision, on one device)
and puts each row where the uninterrupted run logged it. On the CPU the value is the one logged, bit for bit; a run
that validated on several ranks averaged their equal losses, which one rank reproduces up to rounding."""

import sys

import lightning as L
from lightning.fabric.plugins.environments import LightningEnvironment
from omegaconf import DictConfig

from normlab.common.errors import process_rank
from normlab.training.rundir.checkpoints import read_checkpoint
from normlab.training.rundir.directory import RunDirectory
from normlab.training.rundir.tables import METRICS_FILE
from normlab.training.strategies import precision_settings


def validation_trainer(cfg: DictConfig) -> L.Trainer:
    """A Trainer that validates as the run's own does (pipeline.build_trainer: its accelerator and precision plugin,
    the same validation batches), on one device of this process: no logger, no callback, and a cluster of one process
    whatever launched it (LightningEnvironment), so that rank 0 runs it alone and no rank waits for it."""
    trainer = cfg.trainer
    precision, plugins = precision_settings(trainer)
    return L.Trainer(
        accelerator=trainer.accelerator,
        devices=1,
        num_nodes=1,
        precision=precision,
        plugins=[LightningEnvironment(), *plugins],
        logger=False,
        callbacks=[],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=trainer.get("limit_val_batches"),
        inference_mode=trainer.get("inference_mode", True),
        deterministic=trainer.get("deterministic"),
        benchmark=trainer.get("benchmark"),
    )


def revalidate(cfg: DictConfig, run: RunDirectory, module: L.LightningModule, datamodule: L.LightningDataModule):
    """On rank 0, validate the weights of each checkpoint in run.lost_validations (optimizer step -> checkpoint) and
    put its row into metrics.csv as training logs it: at the index of the step before, with its epoch. The module
    keeps the last weights loaded: a run that resumes loads its own checkpoint over them."""
    if process_rank() or not run.lost_validations:
        return
    trainer = validation_trainer(cfg)
    for step, path in sorted(run.lost_validations.items()):
        checkpoint = read_checkpoint(path)
        module.load_state_dict(checkpoint["state_dict"])
        (logged,) = trainer.validate(module, datamodule=datamodule, verbose=False)
        run.tables.put_metrics([{"step": step - 1, "epoch": float(checkpoint["epoch"]), **logged}])
        print(f"{METRICS_FILE}: validated step {step} again from {path.name}", file=sys.stderr, flush=True)
