"""How a run spreads over devices and precisions: sharded training (FSDP2, fully_shard, with the transformer block as
the unit, on GPUs and on the CPU) and bf16 autocast with a fused optimizer."""

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
