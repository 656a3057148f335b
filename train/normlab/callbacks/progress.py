"""Progress of a training run: token throughput and MFU at every step."""

import time

import lightning as L
import torch


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
