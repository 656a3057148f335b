"""RMSNorm over the last dim with fused CPU kernels, so that RMS models are not slower on CPU than LN models.

In torch 2.13 on CPU, F.layer_norm runs fused native kernels forward and backward, while F.rms_norm's backward
is a composite of elementwise ops and reductions (its fwd+bwd measured 5-20x slower than layer_norm's) and
aten._fused_rms_norm_backward has no CPU kernel. A norm that costs several times more would bias every CPU
timing of LN vs RMS, so on CPU `rms_norm` runs its own C++ autograd Function (no Python in the backward): a
forward and a backward kernel, each one pass over each row (which stays in L1), rows split over threads (torch's
CPU _fused_rms_norm forward was slower than layer_norm's, so the forward is ours too). With r = rsqrt(mean(x^2)
+ eps) per row, xhat = x r and gw = g weight:

    y       = xhat weight
    dx      = r (gw - xhat mean(gw xhat))        (mean over the row)
    dweight = sum over rows of g xhat            (per-thread partial sums, added at the end)

accumulated in float32 for bfloat16 (float64 for float64). The kernels are compiled at first use with
-march=native into a torch-extensions folder named by the torch version and a hash of the CPU flags, Python
version and source, so nodes of different CPU types sharing a home directory never load each other's binary.

F.rms_norm does the rest: CUDA tensors (torch has fused kernels there), torch.compile tracing, other dtypes, an
input and weight of different dtypes (as under autocast), and machines where the build fails (one warning).
"""

import fcntl
import hashlib
import os
import re
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

_SOURCE = r"""
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <cmath>

// Rows per task: about GRAIN_SIZE elements, so small inputs stay on one thread.
static int64_t grain(int64_t d) { return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(d, 1)); }

// Loads and stores through the accumulation type; bfloat16 through its bits, so that the loops vectorise.
template <typename T> inline T load(const T* p, int64_t j) { return p[j]; }
inline float load(const at::BFloat16* p, int64_t j) {
  return c10::detail::f32_from_bits(reinterpret_cast<const uint16_t*>(p)[j]);
}
template <typename T> inline void store(T* p, int64_t j, T v) { p[j] = v; }
inline void store(at::BFloat16* p, int64_t j, float v) {
  reinterpret_cast<uint16_t*>(p)[j] = c10::detail::round_to_nearest_even(v);
}

// y = x r w for one row of x; returns r = rsqrt(mean(x^2) + eps).
template <typename T, typename A = at::opmath_type<T>>
A forward_row(const T* __restrict x, const T* __restrict w, T* __restrict y, int64_t d, A eps) {
  A ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < d; ++j) ss += load(x, j) * load(x, j);
  const A r = A(1) / std::sqrt(ss / A(d) + eps);
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) store(y, j, load(x, j) * r * load(w, j));
  return r;
}

// dx = r g w - c x with c = r^3 mean(g w x) for one row; adds g x r to dw.
template <typename T, typename A = at::opmath_type<T>>
void backward_row(const T* __restrict g, const T* __restrict x, const T* __restrict w, A r, T* __restrict dx,
                  A* __restrict dw, int64_t d) {
  A dot = 0;
#pragma omp simd reduction(+ : dot)
  for (int64_t j = 0; j < d; ++j) dot += load(g, j) * load(w, j) * load(x, j);
  const A c = r * r * r * dot / A(d);
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) {
    const A gj = load(g, j), xj = load(x, j);
    store(dx, j, r * gj * load(w, j) - c * xj);
    dw[j] += gj * xj * r;
  }
}

// y and rstd for contiguous x (rows, d).
std::tuple<at::Tensor, at::Tensor> forward_rows(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({x.size(0)}, x.options().dtype(at::toOpMathType(x.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "fused_rms_norm_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t *X = x.data_ptr<scalar_t>(), *W = w.data_ptr<scalar_t>();
    scalar_t* Y = y.data_ptr<scalar_t>();
    acc_t* R = rstd.data_ptr<acc_t>();
    const int64_t d = x.size(1);
    at::parallel_for(0, x.size(0), grain(d), [=](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) R[i] = forward_row(X + i * d, W, Y + i * d, d, acc_t(eps));
    });
  });
  return {y, rstd};
}

// dx and dweight for contiguous g and x (rows, d).
std::tuple<at::Tensor, at::Tensor> backward_rows(const at::Tensor& g, const at::Tensor& x, const at::Tensor& rstd,
                                                 const at::Tensor& w) {
  at::Tensor dx = at::empty_like(x), dw = at::empty_like(w);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "fused_rms_norm_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t *G = g.data_ptr<scalar_t>(), *X = x.data_ptr<scalar_t>(), *W = w.data_ptr<scalar_t>();
    const acc_t* R = rstd.data_ptr<acc_t>();
    scalar_t* DX = dx.data_ptr<scalar_t>();
    const int64_t d = x.size(1), threads = at::get_num_threads();
    std::vector<acc_t> partial(threads * d, acc_t(0));  // one dweight partial sum per thread
    acc_t* P = partial.data();
    at::parallel_for(0, x.size(0), grain(d), [=](int64_t begin, int64_t end) {
      TORCH_CHECK(at::get_thread_num() < threads, "fused rms_norm: more threads than partial sums");
      acc_t* dw = P + at::get_thread_num() * d;
      for (int64_t i = begin; i < end; ++i) backward_row(G + i * d, X + i * d, W, R[i], DX + i * d, dw, d);
    });
    scalar_t* DW = dw.data_ptr<scalar_t>();
    for (int64_t j = 0; j < d; ++j) {
      acc_t sum = 0;
      for (int64_t t = 0; t < threads; ++t) sum += P[t * d + j];
      store(DW, j, sum);
    }
  });
  return {dx, dw};
}

// An autograd Function in C++: its backward runs without Python, at a fraction of a Python Function's overhead.
struct FusedRMSNorm : torch::autograd::Function<FusedRMSNorm> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double eps) {
    auto [y, rstd] = forward_rows(x, w, eps);
    ctx->save_for_backward({x, rstd, w});
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "fused rms_norm: double backward is not supported");
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] = backward_rows(grad[0].contiguous(), saved[0], saved[1], saved[2]);
    return {dx, dw, at::Tensor()};
  }
};

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return FusedRMSNorm::apply(x.reshape({-1, x.size(-1)}).contiguous(), w.contiguous(), eps).view(x.sizes());
}
"""

_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
_extension = None  # the loaded module once built, False once a build has failed


def build_directory() -> tuple[str, Path]:
    """The extension's name and folder: one per CPU's flags, Python, torch and source."""
    from torch.utils.cpp_extension import get_default_build_root

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    key = hashlib.sha1(f"{flags}\n{sys.version}\n{_SOURCE}".encode()).hexdigest()[:10]
    name = f"normlab_rmsnorm_torch{re.sub(r'[^0-9A-Za-z]', '_', torch.__version__)}_{key}"
    return name, Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name


def _build():
    from torch.utils.cpp_extension import load_inline

    name, build_dir = build_directory()
    if not (build_dir / f"{name}.so").exists():
        print(f"normlab: compiling the fused CPU RMSNorm kernel into {build_dir} (once; takes a while)", flush=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "normlab.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # one build at a time; the kernel releases it when its holder dies
        # torch's own lock is a file that a build killed midway (Ctrl-C, a time limit) leaves behind, and every later
        # build would wait for it forever: under our lock, no build of ours is running, so it is stale
        (build_dir / "lock").unlink(missing_ok=True)
        return load_inline(
            name,
            cpp_sources=_SOURCE,
            functions=["rms_norm"],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )


def _loaded():
    global _extension
    if _extension is None:
        try:
            _extension = _build()
        except Exception as exc:  # no compiler, no write access, ...: stay correct, just slower
            warnings.warn(f"fused CPU RMSNorm unavailable ({exc!r}); using F.rms_norm", stacklevel=3)
            _extension = False
    return _extension


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, (d,), weight, eps) over the last dim d; fused forward and backward on CPU."""
    if (
        x.device.type != "cpu"
        or torch.compiler.is_compiling()
        or x.dtype not in _DTYPES
        or weight.dtype != x.dtype
        or weight.shape != x.shape[-1:]
        or not _loaded()
    ):
        return F.rms_norm(x, weight.shape, weight, eps)
    return _extension.rms_norm(x, weight, eps)
