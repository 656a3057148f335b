"""The angle study during training."""

import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from normlab.common.errors import ConfigError
from normlab.data.corpus import load_probe
from normlab.data.tokenizer import EOT
from normlab.probe.hooks import measure
from normlab.probe.sites import norm_sites, stat_rows
from normlab.probe.table import CSV_COLUMNS, PER_DIRECTION_COLUMNS, run_identity
from normlab.training.loader import read_checkpoint
from normlab.training.rundir.checkpoints import checkpoint_steps, verify
from normlab.training.rundir.directory import RunDirectory
from normlab.training.rundir.files import RunDirError, warn


class AngleCallback(L.Callback):
    """The angle study during training: at step 0, at every checkpoint step and at the final step (trainer.max_steps,
    scheduled whatever the intervals: checkpoint_steps), runs the probe set through the model (eval mode, no grad,
    windows split across DDP ranks and the statistics merged), puts the per-layer
    statistics into <run_dir>/angles.csv (through the run directory) and logs them to wandb (scalars and a table).
    When a run starts or resumes, the rows of earlier checkpoint steps that angles.csv lacks (lost with a damaged
    file) are measured again from the scheduled checkpoints. The probe set is loaded (and checked) when the
    callback is built, before the run writes anything."""

    def __init__(
        self,
        probe_dir: str,
        probe_split: str,
        probe_tokens: int | None,
        seq_len: int,
        vocab_size: int,
        batch_size: int,
        every: int,
        dense_until: int,
        sparse_every: int,
        extra_steps=(),
        null_directions: int = 0,
    ):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"probe.batch_size={batch_size}: give a positive number of sequences")
        if not isinstance(null_directions, int) or isinstance(null_directions, bool) or null_directions < 0:
            raise ConfigError(f"probe.null_directions={null_directions}: give a whole number of random directions "
                              "(0: none)")
        self.batch_size, self.null_directions = batch_size, null_directions
        self.schedule = dict(every=every, dense_until=dense_until, sparse_every=sparse_every, extra=tuple(extra_steps))
        self.steps: set[int] = set()
        self.windows = load_probe(probe_dir, probe_split, probe_tokens, seq_len, vocab_size)
        self.run: RunDirectory | None = None

    def setup(self, trainer, pl_module, stage):
        self.steps = set(checkpoint_steps(trainer.max_steps, **self.schedule))
        self.run = RunDirectory.of(trainer)
        if self.run is None:
            raise ConfigError("callbacks.angles writes angles.csv through the run directory: build the Trainer with "
                              "one (pipeline.build_trainer's run)")

    def on_train_start(self, trainer, pl_module):
        """Measure the checkpoint steps up to this one that angles.csv lacks: step 0 of a fresh run, the current
        step of a run resumed from a scheduled checkpoint, rows lost with a damaged angles.csv. The final step, the
        one scheduled step a run written before it was scheduled lacks, is never among them: a run resumed at
        trainer.max_steps is finished and does not train (nor start this), and one resumed before it measures it
        when it gets there; trainer.max_steps identifies the run, so no resume moves it."""
        missing = None
        if trainer.is_global_zero:
            rows_per_step = len(stat_rows(norm_sites(pl_module.model, "normlab")))
            have = self.run.tables.angle_rows_per_step()
            missing = [s for s in sorted(self.steps) if self.run.first_step <= s <= trainer.global_step
                       and have.get(s) != rows_per_step]
        for step in trainer.strategy.broadcast(missing):
            if step == trainer.global_step:
                self._probe(trainer, pl_module, step)
            else:
                self._probe_checkpoint(trainer, pl_module, step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.steps and (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self._probe(trainer, pl_module, trainer.global_step)

    def _probe_checkpoint(self, trainer, pl_module, step: int) -> None:
        """Probe the weights of the scheduled checkpoint of `step` (verified), then put the model's own back."""
        path, problem = self.run.schedule.path(step), None
        if trainer.is_global_zero:
            try:
                verify(path)
            except RunDirError as e:
                problem = str(e)
        problem = trainer.strategy.broadcast(problem)
        if problem:
            if trainer.is_global_zero:
                warn(f"angles.csv lacks step {step}, which cannot be measured again: {problem}")
            return
        own = {k: v.detach().to("cpu", copy=True) for k, v in pl_module.state_dict().items()}
        pl_module.load_state_dict(read_checkpoint(path)["state_dict"])
        self._probe(trainer, pl_module, step, log=False)
        pl_module.load_state_dict(own)
        if trainer.is_global_zero:
            print(f"angles.csv: measured step {step} again from {path.name}", file=sys.stderr)

    def _probe(self, trainer, pl_module, step: int, log: bool = True) -> None:
        model = pl_module.model
        mine = self.windows[trainer.global_rank :: trainer.world_size]  # every window on exactly one rank
        batches = [(b.to(pl_module.device), None) for b in mine.split(self.batch_size)]
        was_training = model.training
        model.eval()
        with torch.compiler.set_stance("force_eager"):  # eager: hooks and eval mode would recompile every block
            stats = measure(
                lambda ids, mask: model(ids, head=False),
                norm_sites(model, "normlab"),
                model.config.n_embd,
                batches,
                pl_module.device,
                self.null_directions,
                EOT,  # the probe is GPT-2 tokens, its documents separated by EOT
            )
        model.train(was_training)
        if trainer.is_global_zero:
            records = stats.records(step, run_identity(pl_module.hparams.config, "training"))
            self.run.tables.write_angles(records, list(CSV_COLUMNS))
            if log:
                self._log_wandb(trainer, records)
                self._log_tensorboard(trainer, records)

    @staticmethod
    def _log_tensorboard(trainer, records: list[dict]) -> None:
        import matplotlib.image

        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.log_metrics(wandb_scalars(records), step=trainer.global_step)
                with tempfile.TemporaryDirectory() as tmp:  # the report's figure is saved and closed: read its PNG
                    figure = layer_figure(records, Path(tmp))
                    image = matplotlib.image.imread(Path(tmp) / figure)[..., :3]
                logger.experiment.add_image("angles-figure/angle_to_1_by_layer", image, trainer.global_step,
                                            dataformats="HWC")

    @staticmethod
    def _log_wandb(trainer, records: list[dict]) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_metrics(wandb_scalars(records), step=trainer.global_step)
                with tempfile.TemporaryDirectory() as tmp:  # wandb copies the image when it is logged
                    figure = layer_figure(records, Path(tmp))
                    logger.log_image(key="angles-figure/angle_to_1_by_layer", images=[str(Path(tmp) / figure)],
                                     step=trainer.global_step)
                columns, data = wandb_table(records)
                logger.log_table(key="angles/table", columns=columns, data=data, step=trainer.global_step)


def wandb_table(records: list[dict]) -> tuple[list[str], list[list]]:
    """The angles table for wandb: every column of angles.csv but the per-direction ones (J numbers a row, for the
    report's nulls, ~9 KB a row each at J = 1,000: angles.csv keeps them), empty cells as None (one type a column)."""
    columns = [c for c in records[0] if c not in PER_DIRECTION_COLUMNS]
    return columns, [[None if r[c] == "" else r[c] for c in columns] for r in records]


def wandb_scalars(records: list[dict]) -> dict[str, float]:
    """The angle rows as wandb panels in sections of one question each (wandb makes a section of each key's part
    before the first '/'), a panel per norm site in forward order: the mean angle to each reference before and after
    the norms (angles-uniform-input, ..., angles-random_b-output), the rotation by the norm (angles-rotation), and of
    1 at the norm inputs: the share of the squared norm along it (share-along-1-input) and the percentile of its mean
    angle among random directions (percentile-1-input)."""
    scalars = {}
    for r in records:
        if r["position"] != "all":
            continue
        role, io = r["site"].split(".")
        panel = f"L{r['layer']:02d}.{role}"
        if io == "rotation":
            scalars[f"angles-rotation/{panel}"] = r["mean_deg"]
            continue
        scalars[f"angles-{r['reference']}-{io}/{panel}"] = r["mean_deg"]
        if r["reference"] == "uniform" and io == "input":
            scalars[f"share-along-1-input/{panel}"] = r["mean_cos2"]
            if r["null_percentile"] != "":
                scalars[f"percentile-1-input/{panel}"] = r["null_percentile"]
    return scalars


def layer_figure(records: list[dict], out: Path) -> str:
    """The report's per-layer figure (normlab.probe.figure) of one probe's rows: the file name written in `out`."""
    from normlab.probe.figure import AngleSeries, plot_angles_by_layer

    rows = [{k: None if v == "" else v for k, v in r.items()} for r in records]  # no null measured: None
    run, norm = rows[0]["run"], rows[0]["norm"]
    return plot_angles_by_layer(run, [AngleSeries(norm, [rows])], out, "angles")
