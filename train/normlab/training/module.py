"""The LightningModule: next-token loss, AdamW with decoupled weight decay on matrices only, and a
per-step schedule of linear warm-up then cosine decay to min_lr_ratio x the peak learning rate."""

import math
from functools import partial
from typing import Callable

import lightning as L
import torch

from normlab.model.gpt import GPT


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
        self.micro_losses: list[torch.Tensor] = []  # of the current optimizer step (NonFiniteGuard reads them)
        self.grad_norm: torch.Tensor | None = None  # of the current step's gradients, where NonFiniteGuard computed it

    def setup(self, stage: str) -> None:
        # Each rank its own dropout stream (rank 0 the single-process one); a resumed run then restores them all
        # (train/normlab/training/rundir/directory.py keeps every rank's generators in the full checkpoints).
        L.seed_everything(self.hparams.seed + self.global_rank, verbose=False)

    def configure_model(self) -> None:
        if self.device_mesh is not None:  # strategy=fsdp (normlab/training/strategies.py): shard block by block
            from normlab.training.strategies import shard_by_block

            shard_by_block(self.model, self.device_mesh["data_parallel"])

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return self.model(x, targets=y)

    def training_step(self, batch, batch_idx):
        torch.compiler.cudagraph_mark_step_begin()  # runtime.compile_mode=reduce-overhead: a new replay (else a no-op)
        loss = self.loss(batch)
        self.micro_losses.append(loss.detach().clone())  # a CUDA graph's output is overwritten by its next replay
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # One value per optimizer step: the loss over its global batch (every micro-batch, every rank).
        if len(self.micro_losses) == self.trainer.accumulate_grad_batches:
            step_loss = torch.stack(self.micro_losses).mean()
            self.micro_losses.clear()
            self.log("train/loss", step_loss, prog_bar=True, sync_dist=True, batch_size=1)

    def validation_step(self, batch, batch_idx):
        torch.compiler.cudagraph_mark_step_begin()
        self.log("val/loss", self.loss(batch), prog_bar=True, sync_dist=True, batch_size=batch[0].shape[0])

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Lightning's clipping, by the gradients' norm NonFiniteGuard already computed where it did (the same
        norm, of the same gradients in the same order: computed once a step, and never read back to the host)."""
        norm, self.grad_norm = self.grad_norm, None
        if norm is None or not gradient_clip_val or gradient_clip_algorithm not in (None, "norm"):
            return self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, norm)

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


def plain_step(module: LanguageModel, optimizer, batch, clip: float, device_type: str = "cpu") -> None:
    """One optimizer step in plain PyTorch, as normlab-train takes it: forward (in bf16 autocast on a GPU), backward,
    clipping, update (normlab-bench's reference for the framework, and its timed and profiled step)."""
    with torch.autocast(device_type, torch.bfloat16, enabled=device_type == "cuda"):
        loss = module.loss(batch)
    loss.backward()
    # the optimizer's parameter order, as Lightning clips: the same norm to the last bit
    torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
