"""The resource plan of a training config, before it is submitted (normlab-describe): per GPU kind, the memory per
GPU under DDP and FSDP, with and without activation checkpointing, whether it fits and the largest micro-batch that
does; the step time and GPU-hours at a stated MFU; the disk its checkpoints take. Pure functions of the config and
the model (built on the meta device); the formulas and what they assume: docs/plan.md.

Memory is counted in bytes of tensors, as torch.cuda.max_memory_allocated counts it; `fits` adds what that leaves
out (FRAGMENTATION, RESERVED).
"""

import math
import re
from dataclasses import dataclass, replace

from omegaconf import DictConfig, ListConfig
from torch import nn

from normlab.common.errors import ConfigError
from normlab.model import norms
from normlab.training.runtime import PEAK_BF16_FLOPS

MIB, GIB = 2**20, 2**30
# Memory of each GPU kind (nvidia-smi's total, MiB) and the name its peak has in PEAK_BF16_FLOPS.
GPU_KINDS = {
    "a100_40gb": ("A100 40GB", 40960, "A100"),
    "a100_80gb": ("A100 80GB", 81920, "A100"),
    "a6000": ("RTX A6000 48GB", 49140, "A6000"),
    "h100": ("H100 SXM 80GB", 81559, "H100"),
    "h100_pcie": ("H100 PCIe 80GB", 81559, "H100 PCIe"),
    "h200": ("H200 141GB", 143771, "H200"),
}
# What torch's allocated bytes leave out: the caching allocator reserves more than it hands out (fragmentation:
# 5-10% in steady training), and the CUDA context, the driver's own share of the memory, cuBLAS and NCCL buffers live
# outside it (0.5-1.5 GiB together).
FRAGMENTATION = 0.10
RESERVED = 2 * GIB
# Tensors the formulas do not itemise: cuBLAS's workspaces (up to 32 MiB per stream on Hopper), the losses and
# metrics a step keeps.
WORKSPACE = 64 * MIB


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int  # bytes
    peak_flops: float | None  # dense bf16 FLOP/s; None for a GPU given by its memory size alone


def gpu(spec: str) -> GPU:
    """A GPU kind of GPU_KINDS, or a memory size such as 80GB (GiB, as GPU memory sizes are meant; no peak FLOP/s)."""
    spec = str(spec)
    if spec.lower() in GPU_KINDS:
        name, mib, peak_name = GPU_KINDS[spec.lower()]
        return GPU(name, mib * MIB, PEAK_BF16_FLOPS[peak_name])
    size = re.fullmatch(r"(\d+(?:\.\d+)?)\s*gi?b", spec.strip().lower())
    if size and float(size[1]) > 0:
        return GPU(spec, int(float(size[1]) * GIB), None)
    raise ConfigError(
        f"unknown GPU '{spec}' in plan.gpus: choose from {', '.join(GPU_KINDS)}, or give a memory size such as 80GB"
    )


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know of a model."""

    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    vocab_size: int
    params: int  # all parameters, a tied matrix once
    block_params: int  # of one transformer block
    block_matmul_weights: int  # weights of one block's matrices: what autocast copies to bf16
    head_rows: int  # its rows padded for the matmul (GPT.head_rows_multiple; model/head_loss.py)
    loss_chunk: int  # tokens per chunk of the head and its loss (GPT.loss_chunk)
    norm_stats: int  # fp32 values per token that a norm saves beside its input: norms.saved_per_token, measured
    flops_per_token: int  # training FLOPs, GPT.flops_per_token()
    dropout: float

    @classmethod
    def of(cls, model) -> "ModelShape":
        c, block = model.config, model.blocks[0]
        return cls(
            n_layer=c.n_layer,
            n_embd=c.n_embd,
            n_head=c.n_head,
            block_size=c.block_size,
            vocab_size=c.vocab_size,
            params=model.num_params(),
            block_params=sum(p.numel() for p in block.parameters()),
            block_matmul_weights=sum(m.weight.numel() for m in block.modules() if isinstance(m, nn.Linear)),
            head_rows=-(-c.vocab_size // model.head_rows_multiple) * model.head_rows_multiple,
            loss_chunk=model.loss_chunk,
            norm_stats=norms.saved_per_token(model.norm_factory, c.n_embd),
            flops_per_token=model.flops_per_token(),
            dropout=c.dropout,
        )

    def recompute_flops_per_token(self) -> int:
        """FLOPs that activation checkpointing adds per token: every block's forward again (2 per matrix weight,
        4 T d for the attention scores and their weighted sum)."""
        return self.n_layer * (2 * self.block_matmul_weights + 4 * self.block_size * self.n_embd)


# -- activations, for `batch` sequences of block_size tokens in eager PyTorch (compiled blocks, runtime.compile, are
# taken to save no more: Inductor's partitioner saves at most what eager autograd would)


@dataclass(frozen=True)
class _Activations:
    block: int  # what one block saves for backward
    block_weight_copies: int  # autocast's bf16 copies of one block's matrices (saved by their matmuls)
    block_input: int  # one residual-stream tensor: all that activation checkpointing keeps of a block
    block_gradients: int  # the largest gradients in flight in a block's backward pass
    outside: int  # what the embeddings, the final norm and the head's loss save
    head_saved: int  # of which the head's loss: the gradients it computed in the forward pass
    head_forward: int  # what the head's loss holds beside them at its peak in the forward pass
    head_backward: int  # the gradients its backward pass hands on (of the hidden states and of the head's weight)


def _activations(shape: ModelShape, batch: int, mixed: bool) -> _Activations:
    s, T = shape, shape.block_size
    N, d = batch * T, shape.n_embd
    a = 2 if mixed else 4  # bytes of a matmul's input: bf16 under autocast, else fp32
    residual = 4 * N * d  # the residual stream stays fp32 under autocast: fp32 embeddings plus bf16 branches
    stats = 4 * N * s.norm_stats
    # A block saves the inputs of its two norms (the residual stream before and after attention) with their
    # statistics; c_attn's input (the norm's output, cast to bf16 under autocast); q, k and v (views of one qkv
    # tensor, 3d wide); the attention output (also c_proj's input: scaled_dot_product_attention writes it in the
    # layout that transpose(1, 2).contiguous() leaves as it is) and its logsumexp (fp32, one per head and token);
    # c_fc's input, GELU's input (c_fc's output, 4d wide) and c_proj's input (GELU's output, 4d wide). Dropout with
    # p = 0 saves nothing.
    block = 2 * (residual + stats) + a * N * d * (1 + 3 + 1 + 1 + 4 + 4) + 4 * N * s.n_head
    # The head's loss (model/head_loss.py) saves the gradients it computed chunk by chunk: of the final norm's output
    # (fp32) and of the head's weight (fp32, its padded rows). At its peak in the forward pass it also holds the
    # padded weight in the matmul's dtype, a chunk of hidden states cast to it, and one chunk's logits: the largest
    # of its three moments (the logits' matmul and fp32 copy; the softmax's gradient cast and padded; the weight's
    # gradient of the chunk).
    V, R, c = s.vocab_size, s.head_rows, min(s.loss_chunk, N)
    head_saved = 4 * N * d + 4 * R * d
    if mixed:
        moments = (a * c * R + 4 * c * V, 4 * c * V + a * c * V + a * c * R, a * c * R + a * R * d)
    else:  # fp32: the logits are a view of the matmul's output, and the weight's gradient is added in place
        moments = (4 * c * R, 8 * c * R, 4 * c * R + 4 * R * d)
    head_forward = a * R * d + (a * c * d if mixed else 0) + max(moments)
    # Outside the blocks: token ids (the embedding), int64, and the positions; the final norm's input and statistics
    outside = 8 * (N + T) + residual + stats + head_saved
    return _Activations(
        block=block,
        # GELU's output and input gradients (4d wide, in the activations' dtype) and the residual stream's (fp32)
        block_gradients=2 * a * N * 4 * d + 2 * residual,
        block_weight_copies=2 * s.block_matmul_weights if mixed else 0,
        block_input=residual,
        outside=outside,
        head_saved=head_saved,
        head_forward=head_forward,
        head_backward=4 * N * d + 4 * V * d,
    )


def saved_activation_bytes(shape: ModelShape, batch: int, mixed: bool, checkpointing: bool) -> int:
    """Bytes autograd holds for the backward pass when the forward pass is done: the tensors saved for backward,
    each storage once, parameters left out (tests/test_plan.py measures them). Under activation checkpointing
    (torch.utils.checkpoint, non-reentrant) a block keeps only its input and is recomputed in the backward pass."""
    act = _activations(shape, batch, mixed)
    per_block = act.block_input if checkpointing else act.block + act.block_weight_copies
    return shape.n_layer * per_block + act.outside


def forward_bytes(shape: ModelShape, batch: int, mixed: bool, checkpointing: bool) -> int:
    """Peak bytes of activations in the forward pass, at the head's loss: the saved tensors and what the loss holds
    beside them, and under checkpointing and autocast the bf16 copies of every block's matrices, which autocast
    caches until the forward pass ends."""
    act = _activations(shape, batch, mixed)
    copies = shape.n_layer * act.block_weight_copies if checkpointing else 0
    return saved_activation_bytes(shape, batch, mixed, checkpointing) + act.head_forward + copies


def loss_backward_bytes(shape: ModelShape, batch: int, mixed: bool, checkpointing: bool) -> int:
    """Peak bytes of activations as the backward pass starts: the saved tensors, and the gradients the loss's
    backward pass hands on."""
    act = _activations(shape, batch, mixed)
    return saved_activation_bytes(shape, batch, mixed, checkpointing) + act.head_backward


def backward_bytes(shape: ModelShape, batch: int, mixed: bool, checkpointing: bool) -> int:
    """Peak bytes of activations later in the backward pass, through the blocks: the saved tensors but the loss's
    (freed by its backward pass), the gradients in flight in a block and, under checkpointing, everything the block
    being recomputed saves."""
    act = _activations(shape, batch, mixed)
    saved = saved_activation_bytes(shape, batch, mixed, checkpointing)
    recompute = act.block + act.block_weight_copies if checkpointing else 0
    return saved - act.head_saved + act.block_gradients + recompute


# -- memory per GPU


@dataclass(frozen=True)
class Setting:
    batch: int  # micro-batch per GPU (data.batch_size)
    accumulate: int  # micro-batches per optimizer step
    world: int  # GPUs: trainer.devices x trainer.num_nodes
    mixed: bool  # bf16 (or fp16) autocast: 16-bit activations
    strategy: str  # ddp, fsdp or single (one device, no wrapper)
    checkpointing: bool  # activation checkpointing


@dataclass(frozen=True)
class Memory:
    weights: int  # fp32 master weights (bf16-mixed keeps them in fp32)
    gradients: int  # fp32 (FSDP: the shard, and the unsharded ones before their reduce-scatter)
    optimizer: int  # AdamW's two fp32 moments
    buckets: int  # DDP's gradient buckets
    gathered: int  # FSDP's gathered parameters
    forward: int  # activations at the end of the forward pass (forward_bytes)
    loss_backward: int  # activations as the backward pass starts (loss_backward_bytes)
    backward: int  # activations later in the backward pass (backward_bytes)
    accumulating: bool  # several micro-batches per step
    workspace: int = WORKSPACE

    @property
    def total(self) -> int:
        """The largest of three moments of a step. Lightning frees the gradients (zero_grad, to None) after the
        forward pass of a step's first micro-batch and before its backward pass: the last step's gradients are
        alive through that forward pass, the backward pass starts without them (unless earlier micro-batches of
        the step made them), and they come back as the backward pass goes on."""
        static = self.weights + self.optimizer + self.buckets + self.gathered + self.workspace
        loss_backward = self.loss_backward + (self.gradients if self.accumulating else 0)
        return static + max(self.gradients + self.forward, loss_backward, self.gradients + self.backward)


def memory_per_gpu(shape: ModelShape, run: Setting) -> Memory:
    """Bytes per GPU of tensors for run.strategy: ddp (everything replicated, plus DDP's buckets: a second copy of
    the gradients, which it all-reduces), fsdp (FSDP2 as training/strategies.py sets it up: weights, gradients and AdamW
    sharded over run.world GPUs, one transformer block per unit, no mixed-precision policy) or single."""
    P = shape.params
    activations = [f(shape, run.batch, run.mixed, run.checkpointing)
                   for f in (forward_bytes, loss_backward_bytes, backward_bytes)]
    if run.strategy == "fsdp":
        shard = math.ceil(P / run.world)
        root = P - shape.n_layer * shape.block_params  # embeddings, final norm, LM head: gathered for the whole step
        # Gathered in fp32 (autocast copies them to bf16 as under DDP): the root's parameters and two blocks' (the
        # running one, the next prefetched). Gradients: the shard, and the root's and one block's unsharded ones
        # before their reduce-scatter.
        gathered = 4 * (root + 2 * shape.block_params)
        gradients = 4 * shard + 4 * (root + shape.block_params)
        return Memory(4 * shard, gradients, 8 * shard, 0, gathered, *activations, run.accumulate > 1)
    buckets = 4 * P if run.strategy == "ddp" else 0
    return Memory(4 * P, 4 * P, 8 * P, buckets, 0, *activations, run.accumulate > 1)


def fits(total: int, gpu: GPU) -> bool:
    return total * (1 + FRAGMENTATION) + RESERVED <= gpu.memory


def max_micro_batch(shape: ModelShape, gpu: GPU, run: Setting) -> int:
    """The largest micro-batch that fits (0: not even one sequence)."""

    def fitting(batch: int) -> bool:
        return fits(memory_per_gpu(shape, replace(run, batch=batch)).total, gpu)

    low, high = 0, 1
    while fitting(high):
        low, high = high, 2 * high
    while high - low > 1:  # fitting(low) and not fitting(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fitting(middle) else (low, middle)
    return low


def fitting_micro_batch(shape: ModelShape, gpu: GPU, run: Setting, per_gpu: int) -> int:
    """The largest micro-batch that divides `per_gpu` (sequences per GPU and optimizer step) and fits `gpu`, the
    step's other micro-batches accumulated (0: not even one sequence fits)."""
    for batch in (b for b in range(per_gpu, 0, -1) if per_gpu % b == 0):
        if fits(memory_per_gpu(shape, replace(run, batch=batch, accumulate=per_gpu // batch)).total, gpu):
            return batch
    return 0


def this_gpu(cfg: DictConfig) -> GPU | None:
    """The GPU this process trains on (its memory as CUDA reports it), or None when it trains on the CPU."""
    import torch

    if str(cfg.trainer.accelerator) not in ("gpu", "cuda", "auto") or not torch.cuda.is_available():
        return None
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    return GPU(properties.name, properties.total_memory, None)


def resolve_micro_batch(cfg: DictConfig, model, gpu: GPU | None) -> str:
    """data.batch_size=auto: the largest micro-batch of this GPU's share of global_batch_size that the plan fits on
    `gpu` (the rest of the share accumulated), written into cfg.data.batch_size; on the CPU (gpu None) the whole
    share. The line that says what was chosen and why."""
    from normlab.training.pipeline import gradient_accumulation

    global_batch, devices, nodes = cfg.get("global_batch_size"), cfg.trainer.devices, cfg.trainer.num_nodes
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (global_batch, devices, nodes)):
        raise ConfigError("data.batch_size=auto needs positive whole numbers as global_batch_size, trainer.devices and "
                          "trainer.num_nodes: give them, or a number of sequences as data.batch_size")
    per_gpu, remainder = divmod(global_batch, devices * nodes)
    if remainder:
        raise ConfigError(f"global_batch_size={global_batch} does not split evenly over trainer.devices={devices} x "
                          f"trainer.num_nodes={nodes}: choose values whose product divides it")
    cfg.data.batch_size = per_gpu
    if gpu is None:
        return f"data.batch_size=auto: {per_gpu} sequences per micro-batch (no GPU: a device's whole share of a step)"
    shape, run = ModelShape.of(model), setting(cfg)
    batch = fitting_micro_batch(shape, gpu, run, per_gpu)
    if batch == 0:
        raise ConfigError(f"data.batch_size=auto: not one sequence fits {gpu.name} ({size(gpu.memory)}) by the "
                          "resource plan: use strategy=fsdp, activation_checkpointing=true or more GPUs")
    cfg.data.batch_size = batch
    planned = memory_per_gpu(shape, replace(run, batch=batch, accumulate=gradient_accumulation(cfg))).total
    return (f"data.batch_size=auto: {batch} sequences per micro-batch, {per_gpu // batch} per step and GPU (the plan "
            f"on {gpu.name}: {size(planned)} of its {size(gpu.memory)})")


def step_seconds(shape: ModelShape, tokens_per_gpu: int, peak_flops: float, mfu: float, checkpointing: bool) -> float:
    """Seconds per optimizer step at `mfu` of the GPU's peak; the FLOPs of recomputed blocks are added to the step
    (the MFU is taken as what the GPU sustains, counted in model FLOPs without recomputation)."""
    flops = shape.flops_per_token + (shape.recompute_flops_per_token() if checkpointing else 0)
    return tokens_per_gpu * flops / (peak_flops * mfu)


# -- the config's setting


def setting(cfg: DictConfig) -> Setting:
    from normlab.training.checks import check_precision
    from normlab.training.pipeline import gradient_accumulation

    devices, nodes = cfg.trainer.devices, cfg.trainer.num_nodes
    if not isinstance(devices, int) or not isinstance(nodes, int) or devices < 1 or nodes < 1:
        raise ConfigError(f"trainer.devices={devices}, trainer.num_nodes={nodes}: the plan needs whole numbers")
    check_precision(cfg.trainer)  # what normlab-train takes, the plan covers
    precision = cfg.trainer.precision
    strategy = cfg.trainer.strategy
    name = str(strategy.get("_target_", "") if isinstance(strategy, DictConfig) else strategy).lower()
    world = devices * nodes
    return Setting(
        batch=cfg.data.batch_size,
        accumulate=gradient_accumulation(cfg),
        world=world,
        mixed=precision.endswith("mixed"),
        strategy="fsdp" if "fsdp" in name else "ddp" if "ddp" in name or world > 1 else "single",
        checkpointing=bool(cfg.get("activation_checkpointing", False)),
    )


@dataclass(frozen=True)
class Disk:
    scheduled: int  # scheduled checkpoints of the run
    scheduled_bytes: int  # each
    full_bytes: int  # last.ckpt, previous.ckpt
    total: int  # at the end of the run
    peak: int  # while last.ckpt is replaced, one more full checkpoint


def checkpoint_disk(cfg: DictConfig, params: int) -> Disk:
    """The run directory's checkpoints (docs/run-directory.md): the scheduled ones hold the weights (4 bytes per
    parameter, fp32) or, with scheduled=full, the full state (12: weights and AdamW's moments), as last.ckpt and
    previous.ckpt do; their configs and counters are a few kB."""
    from normlab.training.rundir.checkpoints import checkpoint_steps

    schedule = cfg.checkpoints
    count = len(checkpoint_steps(cfg.trainer.max_steps, schedule.every, schedule.dense_until, schedule.sparse_every))
    full = 12 * params
    each = full if schedule.scheduled == "full" else 4 * params
    return Disk(count, each, full, count * each + 2 * full, count * each + 3 * full)


# -- normlab-describe's table


def gpus_of(cfg: DictConfig) -> list[GPU]:
    specs = cfg.plan.gpus if isinstance(cfg.plan.gpus, (list, ListConfig)) else [cfg.plan.gpus]
    if not specs:
        raise ConfigError(f"plan.gpus is empty: name GPU kinds ({', '.join(GPU_KINDS)}) or memory sizes such as 80GB")
    return [gpu(s) for s in specs]


def mfu_of(cfg: DictConfig) -> float:
    mfu = cfg.plan.mfu
    if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
        raise ConfigError(f"plan.mfu={mfu}: give the model FLOPs utilisation as a fraction, e.g. 0.4")
    return float(mfu)


def size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.1f} ms"
    if seconds < 60:
        return f"{seconds:.3f} s"
    return f"{seconds / 60:.0f} min" if seconds < 3600 else f"{seconds / 3600:,.1f} h"


def aligned(rows: list[list[str]]) -> list[str]:
    """Rows of cells as lines of left-aligned columns."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(f"{cell:<{width}}" for cell, width in zip(row, widths)).rstrip() for row in rows]


def count(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:.2g}"


def render(cfg: DictConfig, model) -> str:
    """The plan of `cfg` for every GPU of plan.gpus, as plain text."""
    shape, run, gpus, mfu = ModelShape.of(model), setting(cfg), gpus_of(cfg), mfu_of(cfg)
    steps, T = cfg.trainer.max_steps, shape.block_size
    tokens_per_gpu = run.batch * run.accumulate * T
    replicated = "ddp" if run.strategy == "fsdp" else run.strategy  # single: one device, no DDP wrapper
    gpus_text = f"{run.world} GPU{'s' * (run.world > 1)} (devices x nodes)"
    micro_batches = f"{run.accumulate} micro-batch{'es' * (run.accumulate > 1)} per step"
    lines = [
        f"resource plan: {gpus_text}, micro-batch {run.batch} x {T} tokens, {micro_batches} "
        f"({run.batch * run.accumulate * run.world} sequences),",
        f"{steps:,} steps, {cfg.trainer.precision}, MFU {mfu:.0%} (plan.mfu); * the config's strategy and "
        "activation_checkpointing",
    ]
    options = [replace(run, strategy=strategy, checkpointing=checkpointing)
               for strategy in (replicated, "fsdp") for checkpointing in (False, True)]
    table = [["gpu", "strategy", "act. ckpt", "memory/GPU", "fits", "max micro-batch", "step", "wall", "GPU-hours"]]
    for g in gpus:
        for option in options:
            memory = memory_per_gpu(shape, option).total
            row = [g.name, option.strategy + " *" * (option == run), "yes" if option.checkpointing else "no",
                   size(memory), "yes" if fits(memory, g) else "NO", str(max_micro_batch(shape, g, option))]
            if g.peak_flops:
                step = step_seconds(shape, tokens_per_gpu, g.peak_flops, mfu, option.checkpointing)
                row += [duration(step), duration(step * steps), count(step * steps * run.world / 3600)]
            else:
                row += ["-", "-", "-"]  # a GPU given by its memory size: its peak is not known
            table.append(row)
    lines += aligned(table)
    memories = [memory_per_gpu(shape, option) for option in options]
    unit, scale = ("GiB", GIB) if memories[0].total >= GIB else ("MiB", MIB)
    lines += [
        f"memory/GPU at micro-batch {run.batch}, in {unit}: weights + AdamW + DDP buckets or FSDP gathered + "
        "workspace + the largest",
        "of gradients + forward, loss (+ gradients when accumulating), gradients + backward (docs/plan.md):",
    ]
    breakdown = [["", "act. ckpt", "weights", "AdamW", "buckets", "gathered", "workspace", "gradients", "forward",
                  "loss", "backward", "memory/GPU"]]
    for option, m in zip(options, memories):
        values = [m.weights, m.optimizer, m.buckets, m.gathered, m.workspace, m.gradients, m.forward, m.loss_backward,
                  m.backward, m.total]
        breakdown.append([f"  {option.strategy}", "yes" if option.checkpointing else "no",
                          *(f"{value / scale:.1f}" for value in values)])
    lines += aligned(breakdown)
    disk = checkpoint_disk(cfg, shape.params)
    kind = "weights" if disk.scheduled_bytes < disk.full_bytes else "full"
    lines += [
        f"fits: {1 + FRAGMENTATION:.1f} x memory/GPU (allocator fragmentation) + {RESERVED // GIB} GiB (CUDA "
        "context, NCCL) <= the GPU's memory",
        f"disk: {disk.scheduled} scheduled checkpoints ({kind}, {disk.scheduled_bytes / 1e9:.2f} GB each) + last.ckpt "
        f"and previous.ckpt ({disk.full_bytes / 1e9:.2f} GB each)",
        f"  = {disk.total / 1e9:.1f} GB per run, {disk.peak / 1e9:.1f} GB while last.ckpt is replaced",
    ]
    if shape.dropout:
        lines.append(f"note: model.dropout={shape.dropout}: its masks are not counted (the plan assumes 0)")
    return "\n".join(lines)
