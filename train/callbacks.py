"""Callbacks: checkpoints on the paper's step schedule, and token throughput."""

import os
import signal
import subprocess
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.loggers import WandbLogger

from train.angles import append_csv, measure, norm_sites
from train.data import load_probe
from train.errors import ConfigError, NonFiniteError


def checkpoint_steps(max_steps: int, every: int, dense_until: int, sparse_every: int, extra=()) -> list[int]:
    """Step 0, every `every` steps up to `dense_until`, then every `sparse_every` steps up to max_steps
    (the paper: 1K..10K every 1K, then every 10K), plus any `extra` steps."""
    steps = {0, *extra, *range(every, min(dense_until, max_steps) + 1, every)}
    steps.update(range(sparse_every * (dense_until // sparse_every + 1), max_steps + 1, sparse_every))
    return sorted(s for s in steps if 0 <= s <= max_steps)


class ScheduledCheckpoints(Checkpoint):
    """Saves `dirpath/step-NNNNNNN.ckpt` at the optimizer steps of checkpoint_steps(); step 0 holds the initial
    weights, before any update. Like last.ckpt, a checkpoint is written at the end of the validation of its step,
    when every metric of the step is on disk: a run resumed from it neither repeats nor loses a logged row. So
    every checkpoint step, and the last step, must be a validation step."""

    def __init__(self, dirpath: str, every: int, dense_until: int, sparse_every: int, max_steps: int,
                 val_check_interval: int, extra_steps=()):
        self.dirpath = Path(dirpath)
        self.steps = set(checkpoint_steps(max_steps, every, dense_until, sparse_every, extra_steps))
        off = sorted(s for s in self.steps | {max_steps} if s % val_check_interval)
        if off:
            raise ConfigError(f"checkpoint step {off[0]} is not a validation step (trainer.val_check_interval="
                              f"{val_check_interval}): make trainer.max_steps and the callbacks.scheduled_checkpoints "
                              "steps multiples of it")

    def path(self, step: int) -> Path:
        return self.dirpath / f"step-{step:07d}.ckpt"

    def _save(self, trainer) -> None:
        step = trainer.global_step
        if step in self.steps and not self.path(step).exists():
            trainer.save_checkpoint(self.path(step))

    def on_train_start(self, trainer, pl_module):
        self._save(trainer)

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self._save(trainer)


# Dense bf16 tensor-core peak FLOP/s per GPU, from the vendors' data sheets; the first name found in the
# device's name wins (H100 PCIe before H100, which is taken as SXM).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "A6000": 154.8e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


class TokenThroughput(L.Callback):
    """Logs training tokens/s (all devices, and per device) at every optimizer step, measured from
    the end of one step to the end of the next (time spent in validation is left out), and the model
    FLOPs utilisation, train/mfu, where the GPU's peak is known (PEAK_BF16_FLOPS, or peak_flops=)."""

    def __init__(self, peak_flops: float | None = None):
        self.peak_flops = peak_flops
        self._last: float | None = None
        self._tokens = 0

    def setup(self, trainer, pl_module, stage):
        self.peak_flops = self.peak_flops or peak_flops(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._last is None:
            self._last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._tokens += batch[0].numel()
        if (batch_idx + 1) % trainer.accumulate_grad_batches:  # mid gradient accumulation
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        per_device = self._tokens / (now - self._last)
        metrics = {"train/tokens_per_sec": per_device * trainer.world_size, "train/tokens_per_sec_per_device": per_device}
        if self.peak_flops:
            metrics["train/mfu"] = per_device * pl_module.model.flops_per_token() / self.peak_flops
        # Straight to the loggers (as LearningRateMonitor does), at the step self.log gives train/loss: self.log's
        # bookkeeping costs about a millisecond a value, every step.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step - 1)
        self._tokens, self._last = 0, now

    def on_validation_end(self, trainer, pl_module):
        self._last = None  # restart the clock at the next training batch


class AngleCallback(L.Callback):
    """The angle study during training: at step 0 and at every checkpoint step, runs the probe set through
    the model (eval mode, no grad, windows split across DDP ranks and the statistics merged), appends the
    per-layer statistics to <run_dir>/angles.csv and logs them to wandb (scalars and a table). The probe set is
    loaded (and checked) when the callback is built, before the run writes anything."""

    def __init__(self, csv_path: str, probe_dir: str, probe_split: str, probe_tokens: int | None, seq_len: int,
                 vocab_size: int, batch_size: int, every: int, dense_until: int, sparse_every: int, extra_steps=()):
        self.csv_path, self.batch_size = Path(csv_path), batch_size
        self.schedule = dict(every=every, dense_until=dense_until, sparse_every=sparse_every, extra=tuple(extra_steps))
        self.steps: set[int] = set()
        self.windows = load_probe(probe_dir, probe_split, probe_tokens, seq_len, vocab_size)

    def setup(self, trainer, pl_module, stage):
        self.steps = set(checkpoint_steps(trainer.max_steps, **self.schedule))

    def on_train_start(self, trainer, pl_module):
        # step 0; or a run resumed from a scheduled checkpoint, whose angles a kill may have cut off
        if trainer.global_step in self.steps:
            self._probe(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.steps and (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self._probe(trainer, pl_module)

    def _probe(self, trainer, pl_module) -> None:
        model = pl_module.model
        mine = self.windows[trainer.global_rank :: trainer.world_size]  # every window on exactly one rank
        batches = [(b.to(pl_module.device), None) for b in mine.split(self.batch_size)]
        was_training = model.training
        model.eval()
        with torch.compiler.set_stance("force_eager"):  # eager: hooks and eval mode would recompile every block
            stats = measure(lambda ids, mask: model.hidden(ids), norm_sites(model, "normlab"), model.config.n_embd, batches,
                            pl_module.device)
        model.train(was_training)
        if trainer.is_global_zero:
            records = stats.records(trainer.global_step)
            append_csv(self.csv_path, records)
            self._log_wandb(trainer, records)

    @staticmethod
    def _log_wandb(trainer, records: list[dict]) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                scalars = {f"angles/{r['reference']}/{r['site']}/layer{r['layer']:02d}": r["mean_deg"]
                           for r in records if r["position"] == "all"}
                logger.log_metrics(scalars, step=trainer.global_step)
                columns = list(records[0])
                logger.log_table(key="angles/table", columns=columns, data=[[r[c] for c in columns] for r in records],
                                 step=trainer.global_step)


class SlurmRequeue(L.Callback):
    """Slurm preemption and time limits for jobs started with sbatch (`#SBATCH --signal=SIGUSR1@90`): on
    SIGUSR1 the run finishes its optimizer step, saves `checkpoint` and requeues the job (scontrol requeue),
    which resumes from it in the same run directory. Lightning's own handler saves at once, in the middle of
    a step, and then resumes with a logging step one ahead; it is turned off in favour of this one. Under
    Hydra's submitit launcher, submitit handles requeueing and this callback does nothing."""

    def __init__(self, checkpoint: str):
        self.checkpoint = checkpoint
        self.requested = False
        self.active = "SLURM_JOB_ID" in os.environ and os.environ.get("SUBMITIT_EXECUTOR") != "slurm"

    def on_train_start(self, trainer, pl_module):
        if self.active:
            signal.signal(signal.SIGUSR1, self._request)

    def _request(self, signum, frame):
        self.requested = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.active or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        if trainer.strategy.reduce_boolean_decision(self.requested, all=False):  # any rank was signalled
            trainer.save_checkpoint(self.checkpoint)
            trainer.should_stop = True
            if trainer.is_global_zero:
                print(f"SIGUSR1: saved {self.checkpoint} at step {trainer.global_step}; requeueing job {os.environ['SLURM_JOB_ID']}")
                subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)


class NonFiniteGuard(L.Callback):
    """Stops the run at the first optimizer step whose loss or gradients are not finite, before the update is
    applied: writes `<dirpath>/nonfinite-step-NNNNNNN.ckpt` (the state just before that step) for diagnosis,
    leaves every earlier checkpoint as it was, and ends the run with a one-line error naming the step."""

    def __init__(self, dirpath: str):
        self.dirpath = Path(dirpath)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        losses = torch.stack(pl_module._micro_losses) if pl_module._micro_losses else torch.zeros(1)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # One multi-tensor norm and one host sync per step: the norm of all gradients is finite iff each is
        finite = bool(torch.isfinite(losses.sum() + torch.nn.utils.get_total_norm(grads)))
        if trainer.strategy.reduce_boolean_decision(not finite, all=False):  # any rank
            step = trainer.global_step
            good = sorted((p for p in self.dirpath.glob("*.ckpt") if not p.name.startswith("nonfinite")),
                          key=lambda p: p.stat().st_mtime)
            path = self.dirpath / f"nonfinite-step-{step:07d}.ckpt"
            trainer.save_checkpoint(path)
            what = "loss" if not bool(torch.isfinite(losses).all()) else "gradient"
            raise NonFiniteError(f"non-finite {what} at optimizer step {step} (loss {losses.mean().item():.4g}); "
                                 f"diagnostic checkpoint {path}; last good checkpoint {good[-1] if good else 'none'}: "
                                 "lower the learning rate, or resume from an earlier checkpoint")
