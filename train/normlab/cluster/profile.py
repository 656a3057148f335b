"""normlab-bench sections=profile: where a training step's time goes, before anything is optimised. A torch.profiler
trace of `steps` optimizer steps (forward, backward, clipping, fused AdamW: the step normlab-train takes, with the
run's loss path and compile setting) after warm-up steps, written as a Chrome trace (chrome://tracing, Perfetto);
and a table: the step's wall time, the share spent in kernels and outside them (the host's launches, waits and
Python: on a GPU, the time the device stood idle), and the kernels taking the most time. On a GPU the kernels are the
device's; on the CPU the operators' own time."""

import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from normlab.common import outputs

WARMUP_STEPS = 3  # compilation, AdamW's state, the allocator's pools


def written_by_profile(first_line: str) -> bool:
    """A trace written before normlab kept records of its outputs: never taken for one."""
    return False


def kernel_times(prof, on_gpu: bool) -> list[tuple[str, float, int]]:
    """(name, seconds, calls) of every kernel (GPU) or operator (CPU), by its own time, largest first."""
    rows = []
    for event in prof.key_averages():
        seconds = (event.self_device_time_total if on_gpu else event.self_cpu_time_total) / 1e6
        if seconds > 0 and (not on_gpu or event.device_type.name == "CUDA"):
            rows.append((event.key, seconds, event.count))
    return sorted(rows, key=lambda row: -row[1])


def profile_steps(step, steps: int, device: torch.device, trace: Path, what: str, top: int = 10) -> list[tuple]:
    """Profile `steps` calls of `step` (after WARMUP_STEPS) and write the Chrome trace to `trace`; the rows of the
    bench table: wall time per step, in and outside kernels, and the `top` kernels."""
    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    for _ in range(WARMUP_STEPS):
        step()
    sync()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - started) / steps
    kernels = kernel_times(prof, on_gpu)
    busy = sum(seconds for _, seconds, _ in kernels) / steps
    with tempfile.TemporaryDirectory() as tmp:  # the profiler writes a path; the output is placed as every output is
        prof.export_chrome_trace(f"{tmp}/trace.json")
        outputs.write_output(trace, Path(tmp, "trace.json").read_bytes(), "normlab-bench", written_by_profile)
    inside = "in device kernels" if on_gpu else "in operators' own time"
    rows = [(f"profile: {what}, {steps} steps after {WARMUP_STEPS} of warm-up; trace {trace}",
             f"{1e3 * wall:,.1f} ms/step; {inside} {1e3 * busy:,.1f} ms ({busy / wall:.0%}); outside them "
             f"{1e3 * max(0.0, wall - busy):,.1f} ms ({max(0.0, 1 - busy / wall):.0%})")]
    for rank, (name, seconds, calls) in enumerate(kernels[:top], 1):
        rows.append((f"profile top {rank}: {name[:90]}",
                     f"{1e3 * seconds / steps:,.2f} ms/step ({seconds / steps / busy:.1%} of the kernels' time), "
                     f"{calls / steps:,.0f} calls/step"))
    return rows
