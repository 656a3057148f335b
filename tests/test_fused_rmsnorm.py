"""normlab.model.fused_rmsnorm.rms_norm against F.rms_norm: forward, both gradients, every dtype, and the fallback."""

import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from normlab.model import fused_rmsnorm
from normlab.model.fused_rmsnorm import rms_norm

EPS = 1e-5


@pytest.fixture(scope="module", autouse=True)
def built():
    """The extension, built once (cached in the torch extensions folder); a build failure fails the tests."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler: only the fallback would run")
    assert fused_rmsnorm._loaded(), "the fused RMSNorm extension did not build"


def fused(y: torch.Tensor) -> bool:
    """Whether y came out of the fused autograd Function."""
    nodes = [y.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is not None:
            if "FusedRMSNorm" in node.name():
                return True
            nodes += [next_node for next_node, _ in node.next_functions]
    return False


def outputs(norm, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = norm(x, w)
    y.backward(g)
    return y, x.grad, w.grad


def reference(x, w):
    return F.rms_norm(x, w.shape, w, EPS)


def ours(x, w):
    y = rms_norm(x, w, EPS)
    assert fused(y)
    return y


def inputs(d: int, dtype: torch.dtype, contiguous: bool = True):
    gen = torch.Generator().manual_seed(d)
    x = 3 * torch.randn(3, 5, d, generator=gen, dtype=torch.float64)
    if not contiguous:  # same shape, last dim strided
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    w = 1 + 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)
    g = torch.randn(3, 5, d, generator=gen, dtype=torch.float64)
    return x.to(dtype), w.to(dtype), g.to(dtype)


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("d", [64, 512])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_matches_f_rms_norm(d, dtype, tol, contiguous):
    x, w, g = inputs(d, dtype, contiguous)
    for got, want in zip(outputs(ours, x, w, g), outputs(reference, x, w, g)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_rows_split_over_threads():
    x, w, g = inputs(64, torch.float64)
    x, g = x.repeat(1, 100, 1), g.repeat(1, 100, 1)  # 1500 rows: several tasks of GRAIN_SIZE / d rows
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for got, want in zip(outputs(ours, x, w, g), outputs(reference, x, w, g)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10 * want.abs().max().item())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("d", [64, 512])
def test_bfloat16_matches_float32_reference(d):
    x, w, g = inputs(d, torch.bfloat16)
    want = outputs(reference, x.float(), w.float(), g.float())
    for got, want in zip(outputs(ours, x, w, g), want):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_gradcheck():
    x, w, _ = inputs(8, torch.float64)
    x, w = x[:2, :3].clone().requires_grad_(), w.requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, EPS), (x, w))


@pytest.mark.filterwarnings("ignore:Mismatch dtype")
def test_mixed_dtypes_and_tracing_use_f_rms_norm(monkeypatch):
    x, w, _ = inputs(64, torch.bfloat16)
    assert not fused(rms_norm(x, w.float().requires_grad_(), EPS))  # mixed dtypes, as under autocast
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not fused(rms_norm(x, w.requires_grad_(), EPS))


def test_falls_back_once_when_the_build_fails(monkeypatch):
    def no_compiler():
        raise RuntimeError("no compiler")

    monkeypatch.setattr(fused_rmsnorm, "_extension", None)
    monkeypatch.setattr(fused_rmsnorm, "_build", no_compiler)
    x, w, g = inputs(64, torch.float64)
    with pytest.warns(UserWarning, match="no compiler"):
        got = outputs(lambda x, w: rms_norm(x, w, EPS), x, w, g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = outputs(lambda x, w: rms_norm(x, w, EPS), x, w, g)
    for got, again, want in zip(got, again, outputs(reference, x, w, g)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(again, want, rtol=0, atol=0)
    assert not fused(rms_norm(x.requires_grad_(), w, EPS))


def test_a_build_killed_midway_does_not_hang_the_next():
    """torch's lock file, which a build killed midway leaves behind (a Ctrl-C, a time limit), made every later
    build wait for it forever; the next one removes it under normlab's own lock and loads (here within a minute)."""
    fused_rmsnorm._loaded()  # built (or found built) first
    _, folder = fused_rmsnorm.build_directory()
    (folder / "lock").touch()
    loaded = subprocess.run([sys.executable, "-c", "from normlab.model import fused_rmsnorm as f; "
                             "assert f._loaded(), 'not built'"], capture_output=True, text=True, timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    assert not (folder / "lock").exists()
