"""How a run spreads over devices and precisions: sharded training (FSDP2, fully_shard, with the transformer block as
the unit, on GPUs and on the CPU) and bf16 or fp16 autocast with a fused optimizer."""

import torch
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from normlab.model.gpt import GPT


class BlockFSDP(ModelParallelStrategy):
    """Parameters, gradients and optimizer state sharded over all `devices` x `num_nodes` processes. Each transformer
    Block is one FSDP unit, its parameters gathered only while it runs (forward, and its recomputation and backward);
    the embeddings, final norm and LM head form the root unit (LanguageModel.configure_model calls shard_by_block).
    Activation checkpointing (activation_checkpointing=true) recomputes block by block, the same units. Checkpoints
    are gathered into one full file, the format DDP's have: any strategy resumes them and normlab-angles reads them.
    Lightning's ModelParallelStrategy (FSDP2) rather than its FSDPStrategy (FSDP1), which needs a GPU: this one also
    trains on the CPU over gloo, where the tests run it."""

    def __init__(self, devices: int, num_nodes: int, **kwargs):
        super().__init__(
            data_parallel_size=devices * num_nodes, tensor_parallel_size=1, save_distributed_checkpoint=False, **kwargs
        )


def shard_by_block(model: GPT, mesh) -> None:
    """fully_shard each block, then the rest of the model (the root unit), over the 1-D data-parallel `mesh`."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


class BF16Mixed(MixedPrecision):
    """trainer.precision=bf16-mixed: bf16 autocast, and gradient clipping with a fused AdamW. Lightning's plugin
    refuses to clip the gradients of a fused optimizer under any autocast, because a float16 gradient scaler would
    need unscaling first; bf16 has no scaler, so the gradients are clipped as in float32."""

    def __init__(self, device: str):
        super().__init__("bf16-mixed", device)

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)


class FP16Mixed(MixedPrecision):
    """trainer.precision=16-mixed: float16 autocast with a dynamic loss scale (GradScaler), on GPUs and on the CPU
    (Lightning's own would train bf16 on the CPU instead). Lightning leaves the gradients of an optimizer that
    unscales in its own step (the fused AdamW) scaled, so it refuses to clip them; here GradScaler unscales them
    before the step hooks for every optimizer (the fused step then takes them as they are), so that NonFiniteGuard
    and the clipping see the true gradients. A step whose gradients overflow is skipped by the scaler, which halves
    the scale; its state rides in the full checkpoints."""

    def __init__(self, device: str):
        super().__init__("16-mixed", device)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        def unscaled_closure():
            result = closure()
            skipped = result is None and model.automatic_optimization  # no backward: nothing to unscale
            if not skipped and optimizer.defaults.get("fused"):  # it unscales in its step; the others Lightning does
                self.scaler.unscale_(optimizer)
            return result

        return super().optimizer_step(optimizer, model, unscaled_closure, **kwargs)

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)


def precision_settings(trainer) -> tuple[str | None, list]:
    """`trainer.precision` of a trainer config as Lightning's Trainer takes it, with normlab's plugin for it: the
    mixed precisions get BF16Mixed or FP16Mixed (Lightning's own would refuse to clip the fused AdamW's gradients),
    on the GPU when the run trains on one."""
    plugin = {"bf16-mixed": BF16Mixed, "16-mixed": FP16Mixed}.get(trainer.precision)
    if plugin is None:
        return trainer.precision, []
    on_gpu = str(trainer.accelerator) != "cpu" and torch.cuda.is_available()
    return None, [plugin("cuda" if on_gpu else "cpu")]
