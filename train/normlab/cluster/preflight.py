"""normlab-bench sections=preflight: on a GPU node, before the paper runs are submitted, each paper preset trains a
few optimizer steps on one GPU through the real pipeline (build_module and build_trainer: the Lightning Trainer,
bf16-mixed, compiled blocks, fused AdamW, clipping) at the preset's micro-batch, its global batch cut to the share of
one GPU (the same micro-batches per GPU and step as in the real run), on random tokens. One line per preset: PASS
when it ran, its losses and weights stayed finite, its peak memory (torch.cuda.max_memory_allocated over the
measured steps) is within what the plan (cluster/plan.py) predicts for that setting (MEMORY_SLACK above it), and its
MFU (from the measured step time) clears the preset's MFU_FLOOR. On a CPU the same code trains the tiny model,
uncompiled, for a couple of steps; memory and MFU are then not measured."""

import gc
import tempfile
import time
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader

from normlab.cluster import plan
from normlab.common.compose import compose
from normlab.training import runtime
from normlab.training.console import quiet_libraries
from normlab.training.pipeline import build_model, build_module, build_trainer, gradient_accumulation
from normlab.training.runtime import peak_flops

PRESETS = ("paper_70m", "paper_160m", "paper_410m", "paper_1b")
# Half of what each preset reached in this preflight on one H100 (2026-11-26, torch 2.11: 10.1%, 17.6%, 29.2%, 34.8%;
# the small models' matrices keep an H100 far from its peak), so that a failure means something is wrong (a slow
# attention fallback, compilation off, a throttled or shared GPU), not a small model.
MFU_FLOOR = {"paper_70m": 0.05, "paper_160m": 0.08, "paper_410m": 0.14, "paper_1b": 0.17}
# The plan's memory is an estimate: on that H100 each preset's peak came to 1.00 x the plan, a hair above it (what
# the CUDA libraries allocate beside the tensors the plan counts)
MEMORY_SLACK = 0.02
# Optimizer steps: warm-up (compilation, AdamW's state, the allocator's pools), then measured.
GPU_STEPS = (3, 5)
CPU_STEPS = (1, 2)
CPU_SIZE = ["model=tiny", "data.batch_size=2", "trainer.accelerator=cpu", "trainer.strategy=auto",
            "runtime.compile=false"]


class StepClock(L.Callback):
    """Keeps every micro-batch's loss; after `warmup` optimizer steps resets the GPU's peak memory and starts the
    clock, which stops at the end of the last step."""

    def __init__(self, warmup: int):
        self.warmup, self.losses = warmup, []
        self.started = self.ended = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach())
        if (batch_idx + 1) % trainer.accumulate_grad_batches:  # mid gradient accumulation
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self.ended = time.perf_counter()
        if trainer.global_step == self.warmup:
            if pl_module.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            self.started = self.ended


def preset_config(preset: str, overrides: list[str]):
    return compose("train", [f"experiment={preset}", *overrides])


def random_windows(cfg, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` windows of random tokens, as the data module yields them (input, next-token target)."""
    generator = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(0, cfg.model.vocab_size, (count, cfg.model.block_size + 1), generator=generator)
    return [(window[:-1], window[1:]) for window in ids]


def check(preset: str, device: torch.device, micro_batch: str = "preset") -> tuple[str, str]:
    """Train `preset` on one device; (what ran, PASS or FAIL with what was measured). micro_batch: preset (its
    micro-batch, and one GPU's share of its global batch) or auto (on a GPU, its whole global batch on this one GPU
    in the largest micro-batch the plan fits: data.batch_size=auto)."""
    on_gpu = device.type == "cuda"
    warmup, measured = GPU_STEPS if on_gpu else CPU_STEPS
    size = [] if on_gpu else CPU_SIZE
    per_gpu = gradient_accumulation(preset_config(preset, []))  # micro-batches per GPU and step in the real run
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = preset_config(preset, [
            *size, "trainer.devices=1", "trainer.num_nodes=1", f"trainer.max_steps={warmup + measured}",
            f"trainer.log_every_n_steps={warmup + measured}",  # one log line: no wait on the device between steps
            "+trainer.enable_checkpointing=false", "logger=csv", f"run_dir={tmp}",
        ])
        if micro_batch == "auto" and on_gpu:
            with torch.device("meta"):
                shape_only = build_model(cfg)
            plan.resolve_micro_batch(cfg, shape_only, plan.this_gpu(cfg))
        else:
            cfg.global_batch_size = cfg.data.batch_size * per_gpu
        run = plan.setting(cfg)
        name = (f"preflight {preset} ({cfg.model.name} {cfg.norm.name}, micro-batch {run.batch}, {run.accumulate} "
                f"per step, {cfg.trainer.precision}{', compiled' if cfg.runtime.compile else ''}, "
                f"{torch.cuda.get_device_name(device) if on_gpu else 'cpu'})")
        try:
            with runtime.apply(cfg.runtime, 1):
                L.seed_everything(cfg.seed, verbose=False)
                module = build_module(cfg)
                clock = StepClock(warmup)
                trainer = build_trainer(cfg, [clock], run.accumulate)
                windows = random_windows(cfg, (warmup + measured) * run.batch * run.accumulate)
                trainer.fit(module, train_dataloaders=DataLoader(windows, batch_size=run.batch))
        except Exception as e:  # an out-of-memory error, a compilation failure: this preset fails, the next runs
            return name, f"FAIL: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        loss = torch.stack(clock.losses).float()
        finite = bool(torch.isfinite(loss).all()) and all(bool(torch.isfinite(p).all()) for p in module.parameters())
        shape = plan.ModelShape.of(module.model)
    planned = plan.memory_per_gpu(shape, run).total
    seconds = (clock.ended - clock.started) / measured
    results, passed = [], finite
    if on_gpu:
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        fits = allocated <= planned * (1 + MEMORY_SLACK)
        passed &= fits
        results.append(f"peak memory {plan.size(allocated)} = {allocated / planned:.3f} x planned {plan.size(planned)} "
                       f"({'<=' if fits else '>'} {1 + MEMORY_SLACK:.2f}), reserved {plan.size(reserved)}")
    else:
        results.append(f"memory not measured (planned {plan.size(planned)})")
    if peak := peak_flops(device):
        mfu = run.batch * run.accumulate * shape.block_size * shape.flops_per_token / seconds / peak
        floor = MFU_FLOOR[preset]
        passed &= mfu >= floor
        results.append(f"MFU {mfu:.1%} {'>=' if mfu >= floor else '<'} {floor:.0%}")
    else:
        results.append("MFU not measured (no GPU peak known)")
    results.append(f"loss {loss[-1].item():.2f}, {'finite' if finite else 'NOT FINITE'}; "
                   f"{plan.duration(seconds)}/step; {time.perf_counter() - started:.0f} s in all")
    return name, f"{'PASS' if passed else 'FAIL'}: {'; '.join(results)}"


def preflight(device: torch.device, micro_batch: str = "preset") -> list[tuple[str, str]]:
    """One (name, result) row per paper preset (check), each also printed as soon as it is known."""
    quiet_libraries()
    warnings.filterwarnings("ignore", message=".*no `val_dataloader`")  # the preflight only trains
    rows = []
    for preset in PRESETS:
        rows.append(check(preset, device, micro_batch))
        print(f"{rows[-1][0]}: {rows[-1][1]}", flush=True)
        gc.collect()  # the preset's model, optimizer state and compiled code go before the next one starts
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
