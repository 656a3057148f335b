"""Callbacks: token throughput and MFU, the angle study during training, preemption signals, the non-finite guard.
(Checkpoints, and everything else that touches the run directory, are train/normlab/run_dir.py's.)"""

import os
import signal
import subprocess
import sys
import time

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger

from normlab.angles import CSV_COLUMNS, measure, norm_sites, stat_rows
from normlab.data import load_probe
from normlab.errors import ConfigError, Interrupted, NonFiniteError, install_signal_handlers, received
from normlab.run_dir import RunDirError, RunDirectory, checkpoint_steps, verify, warn


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
        metrics = {
            "train/tokens_per_sec": per_device * trainer.world_size,
            "train/tokens_per_sec_per_device": per_device,
        }
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
    the model (eval mode, no grad, windows split across DDP ranks and the statistics merged), puts the per-layer
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
    ):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"probe.batch_size={batch_size}: give a positive number of sequences")
        self.batch_size = batch_size
        self.schedule = dict(every=every, dense_until=dense_until, sparse_every=sparse_every, extra=tuple(extra_steps))
        self.steps: set[int] = set()
        self.windows = load_probe(probe_dir, probe_split, probe_tokens, seq_len, vocab_size)
        self.run: RunDirectory | None = None

    def setup(self, trainer, pl_module, stage):
        self.steps = set(checkpoint_steps(trainer.max_steps, **self.schedule))
        self.run = RunDirectory.of(trainer)
        if self.run is None:
            raise ConfigError(
                "callbacks.angles writes angles.csv through the run directory: keep callbacks.scheduled_checkpoints"
            )

    def on_train_start(self, trainer, pl_module):
        """Measure the checkpoint steps up to this one that angles.csv lacks: step 0 of a fresh run, the current
        step of a run resumed from a scheduled checkpoint, rows lost with a damaged angles.csv."""
        missing = None
        if trainer.is_global_zero:
            rows_per_step = len(stat_rows(norm_sites(pl_module.model, "normlab")))
            have = self.run.angle_rows_per_step()
            missing = [s for s in sorted(self.steps) if s <= trainer.global_step and have.get(s) != rows_per_step]
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
        path, problem = self.run.scheduled_path(step), None
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
        pl_module.load_state_dict(torch.load(path, map_location="cpu", weights_only=False)["state_dict"])
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
                lambda ids, mask: model.hidden(ids),
                norm_sites(model, "normlab"),
                model.config.n_embd,
                batches,
                pl_module.device,
            )
        model.train(was_training)
        if trainer.is_global_zero:
            records = stats.records(step)
            self.run.write_angles(records, list(CSV_COLUMNS))
            if log:
                self._log_wandb(trainer, records)

    @staticmethod
    def _log_wandb(trainer, records: list[dict]) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                scalars = {
                    f"angles/{r['reference']}/{r['site']}/layer{r['layer']:02d}": r["mean_deg"]
                    for r in records
                    if r["position"] == "all"
                }
                logger.log_metrics(scalars, step=trainer.global_step)
                columns = list(records[0])
                logger.log_table(
                    key="angles/table",
                    columns=columns,
                    data=[[r[c] for c in columns] for r in records],
                    step=trainer.global_step,
                )


def requeues_itself() -> bool:
    """Under sbatch the run requeues its own job on SIGUSR1; under Hydra's submitit launcher submitit does."""
    return "SLURM_JOB_ID" in os.environ and os.environ.get("SUBMITIT_EXECUTOR") != "slurm"


class Preemption(L.Callback):
    """On SIGTERM or SIGUSR1 (to any rank) the run finishes its optimizer step, and the validation that follows it
    if one does, saves last.ckpt, and stops when the next step would begin, once every row of the finished step is
    logged and on disk: exit code 128 + the signal's number (143, 138). On SIGUSR1 under sbatch it first requeues
    its Slurm job (scontrol requeue), which resumes from last.ckpt. A signal in the last step lets the run finish
    (a sweep then stops before its next job)."""

    def __init__(self):
        self.stopping = 0  # the signal whose checkpoint is saved: stop at the next step

    def on_train_start(self, trainer, pl_module):
        install_signal_handlers()

    def signal_received(self, trainer) -> int:
        """The stop signal any rank has received (SIGTERM before SIGUSR1), or 0."""
        mine = max(received, default=0)
        if trainer.world_size == 1:
            return mine
        return int(trainer.strategy.reduce(torch.tensor(mine, device=trainer.strategy.root_device), reduce_op="max"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # Saved here, between steps, where Lightning resumes a mid-epoch checkpoint from; a step followed by a
        # validation is saved after it instead (train/normlab/run_dir.py), with the checkpoints of its schedule.
        run = RunDirectory.of(trainer)
        if (batch_idx + 1) % trainer.accumulate_grad_batches or run.validates_after(trainer.global_step):
            return
        if signum := self.signal_received(trainer):
            run.save_last(trainer)
            self.stopping = signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches:
            return
        run = RunDirectory.of(trainer)
        if not self.stopping and run.last_saved_step == trainer.global_step:  # just validated and saved
            self.stopping = self.signal_received(trainer)
        if not self.stopping:
            return
        run.sync_tables()  # the rows of the step saved were logged after the save: on disk before stopping
        what = f"{signal.Signals(self.stopping).name}: saved {run.last_saved} at step {trainer.global_step}"
        if self.stopping == signal.SIGUSR1 and requeues_itself():
            job = os.environ["SLURM_JOB_ID"]
            if trainer.is_global_zero:
                print(f"{what}; requeueing job {job}", flush=True)
                subprocess.run(["scontrol", "requeue", job], check=False)
            raise Interrupted(f"{what}; requeued Slurm job {job}, which resumes from it", self.stopping)
        raise Interrupted(f"{what}; run the same command to resume from it", self.stopping)


class NonFiniteGuard(L.Callback):
    """Stops the run at the first optimizer step whose loss or gradients are not finite, before the update is
    applied: writes `checkpoints/nonfinite-step-NNNNNNN.ckpt` (the state just before that step) for diagnosis,
    leaves every earlier checkpoint as it was, and ends the run with a one-line error naming the step and the last
    checkpoint known to be intact."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        losses = torch.stack(pl_module.micro_losses) if pl_module.micro_losses else torch.zeros(1)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # One multi-tensor norm and one host sync per step: the norm of all gradients is finite iff each is
        finite = bool(torch.isfinite(losses.sum() + torch.nn.utils.get_total_norm(grads)))
        if trainer.strategy.reduce_boolean_decision(not finite, all=False):  # any rank
            step, run = trainer.global_step, RunDirectory.of(trainer)
            path = run.dir / f"nonfinite-step-{step:07d}.ckpt"
            good = run.last_good  # written or verified by this process: never a checkpoint of unknown state
            run.save(trainer, path, weights_only=False)
            what = "loss" if not bool(torch.isfinite(losses).all()) else "gradient"
            raise NonFiniteError(
                f"non-finite {what} at optimizer step {step} (loss {losses.mean().item():.4g}); "
                f"diagnostic checkpoint {path}; last intact checkpoint {good or 'none'}: "
                "lower the learning rate, or resume from an earlier checkpoint"
            )
