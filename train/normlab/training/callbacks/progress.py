"""Progress of a training run: token throughput and MFU at every step, a progress line in the job's log, and the bar
on a terminal."""

import datetime
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from normlab.common.errors import ConfigError
from normlab.training.runtime import peak_flops


class TrainingBar(TQDMProgressBar):
    """Lightning's bar on a terminal, titled "Training": a run is counted in steps (max_epochs=-1), which Lightning's
    default Rich bar titles "Epoch 0/-2"."""

    def on_train_epoch_start(self, trainer: L.Trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description("Training")


class TokenThroughput(L.Callback):
    """Logs training tokens/s (all devices, and per device) at every optimizer step, measured from
    the end of one step to the end of the next (time spent in validation is left out), and the model
    FLOPs utilisation, train/mfu, where the GPU's peak is known (PEAK_BF16_FLOPS, or peak_flops=).
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
        self._last: float | None = None
        self._tokens = 0
        self._started: tuple[float, int] | None = None  # (time, step) when this launch began training

    def setup(self, trainer, pl_module, stage):
        self.peak_flops = self.peak_flops or peak_flops(trainer.strategy.root_device)

    def on_train_start(self, trainer, pl_module):
        self._started = (time.perf_counter(), trainer.global_step)
        self._printed_at = self._started[0]

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
        if trainer.is_global_zero and not sys.stdout.isatty() and self.line_due(trainer.global_step,
                                                                                trainer.max_steps, now):
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
        self._last = None  # restart the clock at the next training batch


def duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))
