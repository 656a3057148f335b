"""Stopping a run cleanly: on a preemption signal (progress saved, exit non-zero), and at the first non-finite loss or
gradient (a diagnostic checkpoint, earlier ones untouched)."""

import os
import signal
import subprocess

import lightning as L
import torch

from normlab.common.errors import (
    SUBMITIT_SIGNAL,
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
    applied: writes `checkpoints/nonfinite-step-NNNNNNN.ckpt` (the state just before that step) for diagnosis,
    leaves every earlier checkpoint as it was, and ends the run with a one-line error naming the step and the last
    checkpoint known to be intact. Under fp16's gradient scaler (16-mixed), gradients that overflow at a finite loss
    are the scaler's business while its scale is at least MIN_LOSS_SCALE: it skips the step and halves the scale."""

    MIN_LOSS_SCALE = 1.0  # from 2**16; below 1 the gradients overflow float16 unscaled: divergence, not warm-up

    def scaler_skips(self, trainer, losses: torch.Tensor) -> bool:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is None or scaler.get_scale() < self.MIN_LOSS_SCALE:
            return False
        return trainer.strategy.reduce_boolean_decision(bool(torch.isfinite(losses).all()), all=True)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        losses = torch.stack(pl_module.micro_losses) if pl_module.micro_losses else torch.zeros(1)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # One multi-tensor norm and one host sync per step: the norm of all gradients is finite iff each is
        finite = bool(torch.isfinite(losses.sum() + torch.nn.utils.get_total_norm(grads)))
        if trainer.strategy.reduce_boolean_decision(not finite, all=False) and not self.scaler_skips(trainer, losses):
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
