"""RMSNorm over the last dim with a fused CPU backward, so that RMS runs are not slowed down by their norm.

In torch 2.13 on CPU, F.layer_norm runs fused native kernels forward and backward, but F.rms_norm's backward
is a composite of elementwise ops and reductions (~5-7x slower than layer_norm's fwd+bwd) and
aten._fused_rms_norm_backward has no CPU kernel. That would make RMS models slower on CPU for no reason of
their own, so on CPU `rms_norm` runs a small C++ kernel instead (one pass over each row, OpenMP over rows).
With r = rsqrt(mean(x^2) + eps) per row, xhat = x r and gw = g weight:

    y       = xhat weight
    dx      = r (gw - xhat mean(gw xhat))        (mean over the row)
    dweight = sum over rows of g xhat

accumulated in float32 for bfloat16 inputs (float64 for float64). The kernel is compiled at first use with
-march=native, into a torch-extensions folder named by the torch version and a hash of the CPU flags and the
source, so nodes of different CPU types sharing a home directory never load each other's binary.

Everything else uses F.rms_norm: CUDA tensors (torch has fused kernels there), torch.compile tracing, other
dtypes or an input and weight of different dtypes (as under autocast), and any machine where the extension
cannot be built (with one warning).
"""

import hashlib
import re
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

_SOURCE = r"""
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <cmath>

// Rows per task: about GRAIN_SIZE elements, so small inputs stay on one thread.
static int64_t grain(int64_t d) { return std::max<int64_t>(1, at::internal::GRAIN_SIZE / d); }

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void forward_rows(const scalar_t* X, const scalar_t* W, scalar_t* Y, acc_t* R, int64_t rows, int64_t d, acc_t eps) {
  at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const scalar_t* x = X + i * d;
      scalar_t* y = Y + i * d;
      acc_t ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < d; ++j) ss += acc_t(x[j]) * acc_t(x[j]);
      const acc_t r = acc_t(1) / std::sqrt(ss / acc_t(d) + eps);
      R[i] = r;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) y[j] = scalar_t(acc_t(x[j]) * r * acc_t(W[j]));
    }
  });
}

// P: one dweight partial sum per thread, summed by the caller.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void backward_rows(const scalar_t* G, const scalar_t* X, const acc_t* R, const scalar_t* W, scalar_t* DX, acc_t* P,
                   int64_t rows, int64_t d) {
  at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
    acc_t* dw = P + at::get_thread_num() * d;
    for (int64_t i = begin; i < end; ++i) {
      const scalar_t* g = G + i * d;
      const scalar_t* x = X + i * d;
      scalar_t* dx = DX + i * d;
      const acc_t r = R[i];
      acc_t dot = 0;  // sum(g w x)
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < d; ++j) dot += acc_t(g[j]) * acc_t(W[j]) * acc_t(x[j]);
      const acc_t c = r * r * r * dot / acc_t(d);  // dx = r g w - c x
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) {
        const acc_t gj = acc_t(g[j]), xj = acc_t(x[j]);
        dx[j] = scalar_t(r * gj * acc_t(W[j]) - c * xj);
        dw[j] += gj * xj * r;
      }
    }
  });
}

std::vector<at::Tensor> forward(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({x.size(0)}, x.options().dtype(at::toOpMathType(x.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "fused_rms_norm_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    forward_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                           rstd.data_ptr<acc_t>(), x.size(0), x.size(1), acc_t(eps));
  });
  return {y, rstd};
}

std::vector<at::Tensor> backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& rstd,
                                 const at::Tensor& w) {
  at::Tensor dx = at::empty_like(x);
  at::Tensor partial = at::zeros({at::get_num_threads(), x.size(1)}, rstd.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "fused_rms_norm_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    backward_rows<scalar_t>(g.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), rstd.data_ptr<acc_t>(),
                            w.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), partial.data_ptr<acc_t>(),
                            x.size(0), x.size(1));
  });
  return {dx, partial.sum(0).to(w.scalar_type())};
}
"""

_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
_extension = None  # the loaded module once built, False once a build has failed


def _build():
    from torch.utils.cpp_extension import get_default_build_root, load_inline

    cpuinfo = Path("/proc/cpuinfo")
    flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "") if cpuinfo.exists() else ""
    key = hashlib.sha1(f"{flags}\n{sys.version}\n{_SOURCE}".encode()).hexdigest()[:10]
    name = f"normlab_rmsnorm_torch{re.sub(r'[^0-9A-Za-z]', '_', torch.__version__)}_{key}"
    build_dir = Path(get_default_build_root()) / name
    if not (build_dir / f"{name}.so").exists():
        print(f"normlab: compiling the fused CPU RMSNorm kernel into {build_dir} (about a minute, once)", flush=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    return load_inline(
        name,
        cpp_sources=_SOURCE,
        functions=["forward", "backward"],
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


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _extension.forward(x, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        dx, dweight = _extension.backward(grad.contiguous(), x, rstd, weight)
        return dx, dweight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, (d,), weight, eps) over the last dim d; fused forward and backward on CPU."""
    if (
        x.device.type != "cpu"
        or torch.compiler.is_compiling()
        or x.dtype not in _DTYPES
        or weight.dtype != x.dtype
        or not _loaded()
    ):
        return F.rms_norm(x, weight.shape, weight, eps)
    d = x.shape[-1]
    return _FusedRMSNorm.apply(x.reshape(-1, d).contiguous(), weight.contiguous(), eps).view(x.shape)
