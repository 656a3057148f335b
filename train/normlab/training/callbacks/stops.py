"""Stopping a run cleanly: on a preemption signal (progress saved, exit non-zero), and at the first non-finite loss or
gradient (a diagnostic checkpoint, earlier ones untouched)."""

import os
import signal
import subprocess

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from normlab.common.errors import (
    SUBMITIT_SIGNAL,
    ConfigError,
    Interrupted,
    NonFiniteError,
    install_signal_handlers,
    received,
    under_submitit,
)
from normlab.training.rundir.directory import RunDirectory


def requeues_itself() -> bool:
    """Under sbatch the run requeues its own job on SIGUSR1; under Hydra's submitit launcher submitit does."""
    return "SLURM_JOB_ID" in os.environ and not under_submitit()


class Preemption(L.Callback):
    """On SIGTERM, SIGUSR1 or SIGINT (Ctrl-C; to any rank) the run finishes its optimizer step, and the validation
    that follows it if one does, saves last.ckpt, and stops when the next step would begin, once every row of the
    finished step is logged and on disk: exit code 128 + the signal's number (143, 138, 130). On SIGUSR1 under
    sbatch it first requeues its Slurm job (scontrol requeue), which resumes from last.ckpt; on SIGUSR2 in a
    submitit job, submitit requeues it after the stop (normlab.cli). A signal in the last step lets the run finish
    (a sweep then stops before its next job). A second Ctrl-C ends the process at once (normlab.common.errors)."""

    def __init__(self):
        self.stopping = 0  # the signal whose checkpoint is saved: stop at the next step

    def on_train_start(self, trainer, pl_module):
        install_signal_handlers()

    def signal_received(self, trainer) -> int:
        """The stop signal any rank has received (SIGTERM before SIGUSR1 before SIGINT), or 0."""
        mine = max(received, default=0)
        if trainer.world_size == 1:
            return mine
        return int(trainer.strategy.reduce(torch.tensor(mine, device=trainer.strategy.root_device), reduce_op="max"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # Saved here, between steps, where Lightning resumes a mid-epoch checkpoint from; a step followed by a
        # validation is saved after it instead (training/rundir/directory.py), with the checkpoints of its schedule.
        run = RunDirectory.of(trainer)
        if (batch_idx + 1) % trainer.accumulate_grad_batches or run.schedule.validates_after(trainer.global_step):
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
        run.tables.sync()  # the rows of the step saved were logged after the save: on disk before stopping
        what = f"{signal.Signals(self.stopping).name}: saved {run.last_saved} at step {trainer.global_step}"
        if self.stopping == SUBMITIT_SIGNAL:
            raise Interrupted(f"{what}; submitit requeues the job, which resumes from it", self.stopping)
        if self.stopping == signal.SIGUSR1 and requeues_itself():
            job = os.environ["SLURM_JOB_ID"]
            if trainer.is_global_zero:
                print(f"{what}; requeueing job {job}", flush=True)
                subprocess.run(["scontrol", "requeue", job], check=False)
            raise Interrupted(f"{what}; requeued Slurm job {job}, which resumes from it", self.stopping)
        raise Interrupted(f"{what}; run the same command to resume from it", self.stopping)


class NonFiniteGuard(L.Callback):
    """Stops the run at the first optimizer step whose loss or gradients are not finite, before the update is
    applied: writes `checkpoints/nonfinite-step-NNNNNNN.ckpt` (the weights and optimizer state just before that step)
    for diagnosis, leaves every earlier checkpoint as it was, and ends the run with a one-line error naming the step
    and the last checkpoint known to be intact.

    Without a wait on the device at every step: the gradients' norm (which clipping then uses, LanguageModel) and
    the verdict stay on the device, and a fused optimizer skips its update there once a step was not finite (as
    under a gradient scaler: every step from that one on is skipped, so the state stays the one before it). The host
    reads the verdict every `check_every` steps, before every validation and checkpoint, and when a stop signal
    came. Where the optimizer cannot skip on the device (not fused), or a gradient scaler owns the skipping, it reads
    it at every step. Under fp16's scaler (16-mixed), gradients that overflow at a finite loss are the scaler's
    business while its scale is at least MIN_LOSS_SCALE: it skips the step and halves the scale."""

    MIN_LOSS_SCALE = 1.0  # from 2**16; below 1 the gradients overflow float16 unscaled: divergence, not warm-up

    def __init__(self, check_every: int = 20):
        if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 1:
            raise ConfigError(f"callbacks.nonfinite_guard.check_every={check_every}: give a positive whole number of "
                              "steps (1: wait for the verdict at every step)")
        self.check_every = check_every
        self.first = None  # on the device: [first non-finite step or -1, its mean loss, 1 if its loss was not finite]
        self.stopped_at: int | None = None

    def scaler_skips(self, trainer, losses: torch.Tensor) -> bool:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is None or scaler.get_scale() < self.MIN_LOSS_SCALE:
            return False
        return trainer.strategy.reduce_boolean_decision(bool(torch.isfinite(losses).all()), all=True)

    def skips_on_device(self, trainer, optimizer) -> bool:
        """Whether the optimizer's step reads a found_inf flag and skips itself (a fused step does, for GradScaler)."""
        return bool(optimizer.defaults.get("fused")) and getattr(trainer.precision_plugin, "scaler", None) is None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        losses = (torch.stack(pl_module.micro_losses) if pl_module.micro_losses
                  else torch.zeros(1, device=pl_module.device))
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        pl_module.grad_norm = torch.nn.utils.get_total_norm(grads)  # one multi-tensor norm, used by clipping too
        norm = pl_module.grad_norm  # FSDP's sharded gradients: a DTensor of the ranks' partial norms, reduced here
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        bad = ~torch.isfinite(losses.sum() + norm)  # the norm of all gradients is finite iff each is
        step = trainer.global_step
        if not self.skips_on_device(trainer, optimizer):
            stops = trainer.strategy.reduce_boolean_decision(bool(bad), all=False)
            if stops and not self.scaler_skips(trainer, losses):
                self.first = torch.tensor([step, losses.mean().item(), float(not torch.isfinite(losses).all())])
                self.stop(trainer)
            return
        if trainer.world_size > 1:  # on the device: no wait (every rank then skips alike)
            bad = trainer.strategy.reduce(bad.float(), reduce_op="max") > 0
        if self.first is None:
            self.first = torch.full((3,), -1.0, device=losses.device)
        new = bad & (self.first[0] < 0)  # Python numbers in torch.where: no copy to the device, hence no wait
        loss_bad = (~torch.isfinite(losses).all()).float()
        self.first = torch.stack([torch.where(new, float(step), self.first[0]),
                                  torch.where(new, losses.mean().float(), self.first[1]),
                                  torch.where(new, loss_bad, self.first[2])])
        optimizer.found_inf = (self.first[0] >= 0).float()  # this step and every later one skipped on the device

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches or self.first is None:
            return
        step, run = trainer.global_step, RunDirectory.of(trainer)
        due = step % self.check_every == 0 or (run and run.schedule.validates_after(step)) or received
        if due and self.first[0].item() >= 0:  # the one wait for the device
            self.stop(trainer)

    def on_train_end(self, trainer, pl_module):
        if self.first is not None and self.first[0].item() >= 0:  # a run that ended between checks
            self.stop(trainer)

    def state_dict(self) -> dict:
        return {"first_nonfinite_step": self.stopped_at} if self.stopped_at is not None else {}

    def stop(self, trainer):
        step, loss, loss_bad = self.first.tolist()
        self.stopped_at, run = int(step), RunDirectory.of(trainer)
        path = run.dir / f"nonfinite-step-{self.stopped_at:07d}.ckpt"
        good = run.last_good  # written or verified by this process: never a checkpoint of unknown state
        run.save(trainer, path, weights_only=False)
        found = (f"; found at step {trainer.global_step}, the steps between skipped"
                 if trainer.global_step > step + 1 else "")
        raise NonFiniteError(
            f"non-finite {'loss' if loss_bad else 'gradient'} at optimizer step {self.stopped_at} (loss {loss:.4g}"
            f"{found}); diagnostic checkpoint {path}; last intact checkpoint {good or 'none'}: "
            "lower the learning rate, or resume from an earlier checkpoint"
        )
