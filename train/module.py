"""The LightningModule: next-token loss, AdamW with decoupled weight decay on matrices only, and a
per-step schedule of linear warm-up then cosine decay to min_lr_ratio x the peak learning rate."""

import math
import random
from functools import partial
from typing import Callable

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn

from train.model import GPT


def rng_states() -> dict:
    """This process's random number generators: what dropout draws from (the data order does not). Only
    tensors and numbers, so that checkpoints load with torch.load(weights_only=True)."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {"torch": torch.get_rng_state(), "numpy": (torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
              "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for the optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LanguageModel(L.LightningModule):
    def __init__(self, model: GPT, optimizer: Callable, warmup_steps: int, max_steps: int,
                 min_lr_ratio: float, seed: int = 0, config: dict | None = None):
        super().__init__()
        self.save_hyperparameters(ignore=["model", "optimizer"])  # the run's full config rides in every checkpoint
        self.model = model
        self.optimizer = optimizer
        self._micro_losses: list[torch.Tensor] = []

    def setup(self, stage: str) -> None:
        # Each rank its own dropout stream (rank 0 the single-process one); a resumed run then restores them all.
        L.seed_everything(self.hparams.seed + self.global_rank, verbose=False)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self._micro_losses.append(loss.detach())
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # One value per optimizer step: the loss over its global batch (every micro-batch, every rank).
        if len(self._micro_losses) == self.trainer.accumulate_grad_batches:
            step_loss = torch.stack(self._micro_losses).mean()
            self._micro_losses.clear()
            self.log("train/loss", step_loss, prog_bar=True, sync_dist=True, batch_size=1)

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.loss(batch), prog_bar=True, batch_size=batch[0].shape[0])

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # Every rank's generators (Lightning keeps none): rank 0 writes the file, so gather them there.
        states = rng_states()
        if dist.is_available() and dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, states)
            checkpoint["rng_states"] = gathered
        else:
            checkpoint["rng_states"] = [states]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        states = checkpoint.get("rng_states", [])
        if len(states) == self.trainer.world_size:
            set_rng_states(states[self.trainer.global_rank])
        elif states:
            rank_zero_warn(f"the checkpoint holds random states of {len(states)} processes, this run has "
                           f"{self.trainer.world_size}: dropout masks will differ from the original run")

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2]},  # matrices and embeddings are decayed
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},  # biases, norm gains
        ]
        optimizer = self.optimizer(groups)
        h = self.hparams
        schedule = partial(lr_factor, warmup_steps=h.warmup_steps, max_steps=h.max_steps, min_lr_ratio=h.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
