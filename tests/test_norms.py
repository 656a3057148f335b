"""The norms against torch and against the identities of the seeds (float64, random inputs); DyT against its formula."""

import pytest
import torch

from normlab.model.norms import DyT, LayerNorm, RMSNorm

D = 64


@pytest.fixture
def x():
    return torch.randn(32, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3 + 0.7


def randomize(norm, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return norm


def test_layernorm_equals_torch(x):
    ours = randomize(LayerNorm(D, eps=1e-5).double())
    ref = torch.nn.LayerNorm(D, eps=1e-5, dtype=torch.float64)
    ref.load_state_dict(ours.state_dict())
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-12, atol=1e-12)


def test_rmsnorm_equals_torch(x):
    ours = randomize(RMSNorm(D, eps=1e-5).double())
    ref = torch.nn.RMSNorm(D, eps=1e-5, dtype=torch.float64)
    ref.load_state_dict(ours.state_dict())
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-12, atol=1e-12)


def test_layernorm_is_rmsnorm_of_centred_input_then_affine(x):
    ln = randomize(LayerNorm(D).double())
    unit_rms = RMSNorm(D).double()  # gain 1
    expected = unit_rms(x - x.mean(-1, keepdim=True)) * ln.weight + ln.bias
    torch.testing.assert_close(ln(x), expected, rtol=1e-12, atol=1e-12)


def test_standardized_layernorm_is_orthogonal_to_uniform_vector_with_norm_sqrt_d(x):
    standardize = LayerNorm(D, eps=1e-12, bias=True).double()  # gamma = 1, beta = 0: pre-affine output
    y = standardize(x)
    ones = torch.ones(D, dtype=torch.float64)
    torch.testing.assert_close(y @ ones, torch.zeros(len(x), dtype=torch.float64), rtol=0, atol=1e-10)
    torch.testing.assert_close(y.norm(dim=-1), torch.full((len(x),), D**0.5, dtype=torch.float64), rtol=1e-9, atol=0)


@pytest.mark.parametrize("c", [1e-3, 0.5, 7.0, 1e4])
def test_rmsnorm_is_scale_invariant(x, c):
    rms = randomize(RMSNorm(D, eps=0.0).double())
    torch.testing.assert_close(rms(c * x), rms(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("t", [-5.0, 0.3, 100.0])
def test_layernorm_cannot_see_the_uniform_direction(x, t):
    ln = randomize(LayerNorm(D).double())
    torch.testing.assert_close(ln(x + t * torch.ones(D, dtype=torch.float64)), ln(x), rtol=1e-9, atol=1e-9)


def test_rmsnorm_does_see_the_uniform_direction(x):
    rms = RMSNorm(D).double()
    assert not torch.allclose(rms(x + 5.0), rms(x))


def test_norms_share_eps_and_differ_in_bias_only():
    ln, rms = LayerNorm(D), RMSNorm(D)
    assert ln.eps == rms.eps
    assert sorted(n for n, _ in ln.named_parameters()) == ["bias", "weight"]
    assert [n for n, _ in rms.named_parameters()] == ["weight"]


@pytest.mark.parametrize("bias", [True, False])
def test_dyt_is_gamma_tanh_alpha_x_plus_beta(x, bias):
    dyt = randomize(DyT(D, bias=bias).double())  # alpha, gamma (and beta) random
    assert dyt.alpha.shape == (1,) and dyt.alpha.item() != 0.5
    expected = torch.tanh(dyt.alpha.item() * x) * dyt.weight
    torch.testing.assert_close(dyt(x), expected + dyt.bias if bias else expected, rtol=1e-12, atol=1e-12)
    assert sorted(n for n, _ in dyt.named_parameters()) == ["alpha", *(["bias"] if bias else []), "weight"]


@pytest.mark.parametrize("alpha_init", [0.5, 0.2, 1.3])
def test_dyt_starts_and_resets_at_alpha_init_without_random_draws(alpha_init):
    rng = torch.get_rng_state()
    dyt = DyT(D, alpha_init=alpha_init)
    assert torch.equal(torch.get_rng_state(), rng)  # built without drawing
    assert dyt.alpha.tolist() == [torch.tensor(alpha_init).item()] and not dyt.bias.any() and dyt.weight.eq(1).all()
    randomize(dyt)
    dyt.reset_parameters()
    assert torch.equal(torch.get_rng_state(), rng)
    assert dyt.alpha.tolist() == [torch.tensor(alpha_init).item()] and not dyt.bias.any() and dyt.weight.eq(1).all()
