"""Callbacks: checkpoints on the paper's step schedule, and token throughput."""

import time
from pathlib import Path

import lightning as L
import torch


def checkpoint_steps(max_steps: int, every: int, dense_until: int, sparse_every: int, extra=()) -> list[int]:
    """Step 0, every `every` steps up to `dense_until`, then every `sparse_every` steps up to max_steps
    (the paper: 1K..10K every 1K, then every 10K), plus any `extra` steps."""
    steps = {0, *extra, *range(every, min(dense_until, max_steps) + 1, every)}
    steps.update(range(sparse_every * (dense_until // sparse_every + 1), max_steps + 1, sparse_every))
    return sorted(s for s in steps if 0 <= s <= max_steps)


class ScheduledCheckpoints(L.Callback):
    """Saves `dirpath/step-NNNNNNN.ckpt` at the optimizer steps of checkpoint_steps(); step 0 holds
    the initial weights, before any update."""

    def __init__(self, dirpath: str, every: int, dense_until: int, sparse_every: int, extra_steps=()):
        self.dirpath = Path(dirpath)
        self.schedule = dict(every=every, dense_until=dense_until, sparse_every=sparse_every, extra=tuple(extra_steps))
        self.steps: set[int] = set()

    def setup(self, trainer, pl_module, stage):
        self.steps = set(checkpoint_steps(trainer.max_steps, **self.schedule))

    def path(self, step: int) -> Path:
        return self.dirpath / f"step-{step:07d}.ckpt"

    def _save(self, trainer) -> None:
        step = trainer.global_step
        if step in self.steps and not self.path(step).exists():
            trainer.save_checkpoint(self.path(step))

    def on_train_start(self, trainer, pl_module):
        self._save(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._save(trainer)


class TokenThroughput(L.Callback):
    """Logs training tokens/s (all devices, and per device) at every optimizer step, measured from
    the end of one step to the end of the next; time spent in validation is left out."""

    def __init__(self):
        self._last: float | None = None
        self._tokens = 0

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
        pl_module.log("train/tokens_per_sec", per_device * trainer.world_size, batch_size=1)
        pl_module.log("train/tokens_per_sec_per_device", per_device, batch_size=1)
        self._tokens, self._last = 0, now

    def on_validation_end(self, trainer, pl_module):
        self._last = None  # restart the clock at the next training batch
