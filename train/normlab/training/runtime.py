"""Speed settings of a training process (`runtime:` in conf/train.yaml). None of them changes what is computed
beyond floating-point rounding, and each can be switched off from the command line."""

import contextlib
import ctypes
import os

import torch
from omegaconf import DictConfig
from torch.nn.attention import SDPBackend, sdpa_kernel

from normlab.common.errors import ConfigError

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
ATTENTION = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
# Dense bf16 tensor-core peak FLOP/s per GPU, from the vendors' data sheets (train/mfu and the plan's step time); the
# first name found in the device's name wins (H100 PCIe before H100, which is taken as SXM).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "A6000": 154.8e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def threads_per_process(threads: int | None, processes_per_node: int) -> int:
    """`threads`, or the cores this process may run on shared by the training processes of its node."""
    return threads or max(1, len(os.sched_getaffinity(0)) // max(1, processes_per_node))


def keep_freed_memory() -> bool:
    """glibc: never return freed memory to the system, and serve big blocks from the heap rather than fresh
    mmaps. Training allocates the same large activations at every step; without this, each step page-faults them
    in again (system time) on CPU. False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def apply(runtime: DictConfig, processes_per_node: int) -> contextlib.AbstractContextManager:
    """Set threads, allocator and matmul precision for this process; return the context in which to train
    (the attention backend)."""
    torch.set_num_threads(threads_per_process(runtime.threads, processes_per_node))
    if runtime.keep_freed_memory:
        keep_freed_memory()
    torch.set_float32_matmul_precision(runtime.matmul_precision)
    if runtime.attention is None:
        return contextlib.nullcontext()
    if runtime.attention not in ATTENTION:
        raise ConfigError(f"runtime.attention={runtime.attention}: choose one of {', '.join(ATTENTION)}, or null")
    return sdpa_kernel(ATTENTION[runtime.attention])
