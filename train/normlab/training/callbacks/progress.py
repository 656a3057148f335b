"""Progress of a training run: token throughput and MFU at every step, a progress line in the job's log, and the bar
on a terminal."""

import datetime
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from normlab.common.errors import ConfigError
from normlab.training.rundir.directory import RunDirectory
from normlab.training.runtime import peak_flops


class TrainingBar(TQDMProgressBar):
    """Lightning's bar on a terminal, titled "Training": a run is counted in steps (max_epochs=-1), which Lightning's
    default Rich bar titles "Epoch 0/-2"."""

    def on_train_epoch_start(self, trainer: L.Trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description("Training")


class TokenThroughput(L.Callback):
    """Logs training tokens/s (all devices, and per device) and the model FLOPs utilisation, train/mfu, where the
    GPU's peak is known (PEAK_BF16_FLOPS, or peak_flops=), over the optimizer steps since its last measurement (time
    in validation left out). It measures at the loggers' cadence (trainer.log_every_n_steps: every step on the CPU,
    where nothing waits), at the last step before a validation and when a progress line is due: on a GPU by CUDA
    events, whose one wait for the device is then, never at the steps between.
    When the output is not a terminal (a Slurm job's log), where no progress bar is drawn, rank 0 prints a progress
    line every `print_every` optimizer steps or `print_every_seconds` seconds, whichever comes first (and at the
    last step): step/max, loss, lr, tokens/s, MFU, elapsed, ETA. The seconds keep a slow run's log moving (a CPU
    step can take seconds, a 1B step on a GPU too); the steps keep a fast one's lines comparable."""

    def __init__(self, peak_flops: float | None = None, print_every: int = 100,
                 print_every_seconds: float | None = 45):
        if not isinstance(print_every, int) or isinstance(print_every, bool) or print_every < 1:
            raise ConfigError(f"callbacks.throughput.print_every={print_every}: give a positive whole number of steps")
        if print_every_seconds is not None and not (isinstance(print_every_seconds, (int, float))
                                                    and 0 <= print_every_seconds < float("inf")):
            raise ConfigError(f"callbacks.throughput.print_every_seconds={print_every_seconds}: give a number of "
                              "seconds >= 0, or null for lines by steps only")
        self.peak_flops = peak_flops
        self.print_every, self.print_every_seconds = print_every, print_every_seconds
        self._printed_at = 0.0
        self._window: Clock | None = None  # since the last measurement
        self._tokens = 0
        self._started: tuple[float, int] | None = None  # (time, step) when this launch began training

    def setup(self, trainer, pl_module, stage):
        self.peak_flops = self.peak_flops or peak_flops(trainer.strategy.root_device)

    def on_train_start(self, trainer, pl_module):
        self._started = (time.perf_counter(), trainer.global_step)
        self._printed_at = self._started[0]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._window is None:
            self._window = Clock(pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._tokens += batch[0].numel()
        if (batch_idx + 1) % trainer.accumulate_grad_batches:  # mid gradient accumulation
            return
        step, now = trainer.global_step, time.perf_counter()
        run = RunDirectory.of(trainer)
        line = trainer.is_global_zero and not sys.stdout.isatty() and self.line_due(step, trainer.max_steps, now)
        if not (step % trainer.log_every_n_steps == 0 or line or (run and run.schedule.validates_after(step))):
            return
        per_device = self._tokens / self._window.seconds()
        metrics = {
            "train/tokens_per_sec": per_device * trainer.world_size,
            "train/tokens_per_sec_per_device": per_device,
        }
        if self.peak_flops:
            metrics["train/mfu"] = per_device * pl_module.model.flops_per_token() / self.peak_flops
        # Straight to the loggers (as LearningRateMonitor does), at the step self.log gives train/loss: self.log's
        # bookkeeping costs about a millisecond a value, every step.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step - 1)
        self._tokens, self._window = 0, Clock(pl_module.device)
        if line:
            print(self.progress_line(trainer, pl_module, metrics, now), flush=True)
            self._printed_at = now

    def line_due(self, step: int, max_steps: int, now: float) -> bool:
        seconds = self.print_every_seconds
        return (step % self.print_every == 0 or step == max_steps
                or (seconds is not None and now - self._printed_at >= seconds))

    def progress_line(self, trainer, pl_module, metrics: dict, now: float) -> str:
        step, max_steps = trainer.global_step, trainer.max_steps
        began, first_step = self._started
        elapsed = now - began
        rate = (step - first_step) / elapsed  # steps/s of this launch, validations and checkpoints included
        loss = torch.stack(pl_module.micro_losses).mean().item()  # of the step just taken, on rank 0
        parts = [
            f"step {step}/{max_steps} ({step / max_steps:.0%})",
            f"loss {loss:.4f}",
            f"lr {trainer.optimizers[0].param_groups[0]['lr']:.3g}",
            f"{metrics['train/tokens_per_sec']:,.0f} tokens/s",
            *([f"MFU {metrics['train/mfu']:.1%}"] if "train/mfu" in metrics else []),
            f"elapsed {duration(elapsed)}",
            f"ETA {duration((max_steps - step) / rate)}",
        ]
        return " | ".join(parts)

    def on_validation_end(self, trainer, pl_module):
        self._window, self._tokens = None, 0  # restart the clock at the next training batch


class Clock:
    """Seconds from its making to seconds(): by CUDA events on a GPU (their wait is in seconds()), else by the
    wall clock."""

    def __init__(self, device: torch.device):
        self.start = time.perf_counter()
        self.events = None
        if device.type == "cuda":
            self.events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.events[0].record()

    def seconds(self) -> float:
        if self.events is None:
            return time.perf_counter() - self.start
        self.events[1].record()
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]) / 1000


def duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))
