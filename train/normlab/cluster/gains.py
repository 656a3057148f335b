"""normlab-bench sections=gains and sections=precision: what each speed setting of the training step buys, and what
16-bit autocast does to the losses, measured side by side in one run.

gains: the step section's optimizer step with every setting on (on a GPU: the whole model compiled, the head's
rows padded to 128, its loss in chunks) against the same step with one setting switched off at a time, on the same
batch, interleaved; each off / on time ratio (above 1: the setting's gain) and, on a GPU, the peak memory of both.
Compilation's variants run on a GPU only: on a CPU, Inductor's compile time would dwarf the steps timed.

precision: the same model trained for a few steps on the same batches in float32, bf16 autocast and fp16 autocast
(with a gradient scaler, as 16-mixed trains), each step's loss set against float32's."""

import statistics

import torch

# (what is switched off, the overrides that switch it off); compilation's only on a GPU
SETTINGS_OFF = [
    ("head padded to 128 rows", ["runtime.head_rows_multiple=1"]),
    ("loss in chunks", ["runtime.loss_chunk={tokens}"]),  # one chunk of every token: the whole logits at once
]
COMPILE_OFF = [
    ("whole model compiled (blocks only)", ["runtime.compile=blocks"]),
    ("compiled at all (eager)", ["runtime.compile=false"]),
]


def peak_memory(step, device) -> int | None:
    """Peak bytes allocated over one call of `step` on a GPU (None on the CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device)


def bench_gains(device, repeats: int, shape: list[str], batch: int, norm: str, compose, training_step, interleaved):
    """Rows of the gains section: `shape` and `batch` are the step section's (bench.step_shape); `compose`,
    `training_step` and `interleaved` normlab-bench's own."""
    on_gpu = device.type == "cuda"
    tokens = batch * compose(shape).model.block_size
    variants = {"all on": []}
    for what, overrides in SETTINGS_OFF + (COMPILE_OFF if on_gpu else []):
        variants[what] = [o.format(tokens=tokens) for o in overrides]
    steps, memory = {}, {}
    for what, overrides in variants.items():
        _, steps[what] = training_step(compose([*shape, f"norm={norm}", *overrides]), device, batch)
        memory[what] = peak_memory(steps[what], device)
    seconds = interleaved(steps, repeats, device)
    on = seconds["all on"]
    name = f"{shape[0][6:]}, {norm}, {batch}x{tokens // batch} tokens, {device.type}"
    rows = [(f"gains: all settings on ({name})", f"{1e3 * on:,.1f} ms/step, {tokens / on:,.0f} tokens/s"
             + (f", peak memory {memory['all on'] / 2**30:.1f} GiB" if on_gpu else ""))]
    for what in list(variants)[1:]:
        off = seconds[what]
        row = f"{off / on:.3f} x the step time with it on; {tokens / off:,.0f} tokens/s"
        if on_gpu:
            row += f"; peak memory {memory[what] / 2**30:.1f} GiB (on: {memory['all on'] / 2**30:.1f} GiB)"
        rows.append((f"gains: without {what} ({name})", row))
    return rows


def train_losses(module, batches, dtype, device) -> list[float]:
    """Each step's loss over `batches` (before its update), in autocast to `dtype` (None: float32), fp16 with a
    gradient scaler; gradients clipped to norm 1 as normlab-train clips them."""
    optimizer = module.configure_optimizers()["optimizer"]
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    losses = []
    for batch in batches:
        with torch.autocast(device.type, dtype or torch.bfloat16, enabled=dtype is not None):
            loss = module.loss(batch)
        losses.append(loss.item())
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return losses


def bench_precision(device, steps: int, shape: list[str], batch: int, norm: str, compose):
    """Rows of the precision section: the same initial weights and batches in float32, bf16 and fp16 autocast."""
    from normlab.training.pipeline import build_module

    cfg = compose([*shape, "runtime.compile=false", f"norm={norm}"])
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (steps, batch, cfg.model.block_size + 1), generator=generator)
    batches = [(b[:, :-1].to(device), b[:, 1:].to(device)) for b in ids]
    losses = {}
    for label, dtype in (("float32", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        losses[label] = train_losses(build_module(cfg).to(device), batches, dtype, device)
    model = cfg.model
    name = f"{model.name} ({model.n_layer} layers), {norm}, {batch}x{model.block_size} tokens, {device.type}"
    fp32 = losses["float32"]
    rows = [(f"precision: float32 losses ({name}, {steps} steps)", f"first {fp32[0]:.4f}, last {fp32[-1]:.4f}")]
    for label in ("bf16", "fp16"):
        differences = [abs(a - b) for a, b in zip(losses[label], fp32)]
        rows.append((f"precision: {label} autocast against float32 ({name}, {steps} steps)",
                     f"absolute loss difference: largest {max(differences):.4f}, median "
                     f"{statistics.median(differences):.4f}, last {differences[-1]:.4f}; last loss "
                     f"{losses[label][-1]:.4f}"))
    return rows
