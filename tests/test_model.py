"""The GPT-2 pre-norm decoder: exact parameter counts of the paper presets, structure, causality."""

import pytest
import torch

from conftest import compose_config, run_cli
from normlab.common.errors import ConfigError
from normlab.model.gpt import GPT, GPTConfig
from normlab.model.norms import LayerNorm, RMSNorm
from normlab.training.pipeline import build_model

# ../shared/REFERENCE.md section 2: GPT-2 blocks with biases, LayerNorm with bias, vocab 50257, context 1024.
PAPER_COUNTS = {  # preset: (layers, d, tied count, untied count)
    "70m": (6, 512, 45_171_200, 70_902_784),
    "160m": (12, 768, 124_439_808, 163_037_184),
    "410m": (24, 1024, 354_823_168, 406_286_336),
    "1b": (16, 2048, 910_759_936, 1_013_686_272),
}


def meta_model(overrides):
    with torch.device("meta"):
        return build_model(compose_config("train", overrides))


@pytest.mark.parametrize("preset", PAPER_COUNTS)
def test_paper_presets_have_the_reference_parameter_counts(preset):
    layers, d, tied, untied = PAPER_COUNTS[preset]
    ln = meta_model([f"model={preset}", "norm=layernorm"])
    assert (ln.config.n_layer, ln.config.n_embd) == (layers, d)
    assert ln.num_params() == untied  # untied is the default: the names count both embeddings
    assert meta_model([f"model={preset}", "norm=layernorm", "model.tie_embeddings=true"]).num_params() == tied
    rms = meta_model([f"model={preset}", "norm=rmsnorm"])
    assert ln.num_params() - rms.num_params() == (2 * layers + 1) * d
    assert rms.num_params(non_embedding=True) == ln.num_params(non_embedding=True) - (2 * layers + 1) * d
    assert ln.num_params(non_embedding=True) == layers * (12 * d * d + 13 * d) + 2 * d


@pytest.mark.parametrize("preset,lr", [("70m", 1e-3), ("160m", 6e-4), ("410m", 3e-4), ("1b", 3e-4)])
def test_paper_presets_carry_table_2_shapes_and_learning_rates(preset, lr):
    cfg = compose_config("train", [f"model={preset}"])
    assert cfg.optimizer.lr == lr
    assert cfg.model.block_size == 1024 and cfg.model.vocab_size == 50257


def test_describe_prints_exact_counts_for_1b_without_allocating():
    result = run_cli("normlab-describe", "model=1b", "norm=rmsnorm")
    assert result.returncode == 0, result.stderr
    assert "1,013,618,688" in result.stdout  # 1,013,686,272 - (2*16+1)*2048
    assert "805,668,864" in result.stdout  # non-embedding
    with torch.device("meta"):
        model = GPT(GPTConfig(16, 8, 2048), LayerNorm)
    assert f"{model.flops_per_token():,}" in result.stdout
    assert all(p.is_meta for p in model.parameters())


def tiny(norm=LayerNorm, seed=0):
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=50), norm)
    model.init_weights(seed)
    return model.double()


@pytest.mark.parametrize("norm", [LayerNorm, RMSNorm])
def test_block_computes_appendix_a1(norm):
    """f = N1(h); a = Att(f); g = N2(h + a); m = MLP(g); h' = h + a + m."""
    block = tiny(norm).blocks[0]
    h = torch.randn(3, 8, 16, dtype=torch.float64)
    a = block.attn(block.ln_1(h))
    m = block.mlp(block.ln_2(h + a))
    torch.testing.assert_close(block(h), h + a + m)


def test_model_is_causal_and_ends_with_final_norm_and_head():
    model = tiny()
    idx = torch.randint(0, 50, (2, 8))
    changed = idx.clone()
    changed[:, 5] = (idx[:, 5] + 1) % 50
    logits, logits_changed = model(idx), model(changed)
    torch.testing.assert_close(logits[:, :5], logits_changed[:, :5])
    assert not torch.allclose(logits[:, 5:], logits_changed[:, 5:])
    h = model.wte(idx) + model.wpe(torch.arange(8))
    for block in model.blocks:
        h = block(h)
    torch.testing.assert_close(logits, model.lm_head(model.ln_f(h)))


def test_embeddings_are_untied_unless_asked():
    assert tiny().lm_head.weight is not tiny().wte.weight
    tied = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=50, tie_embeddings=True), LayerNorm)
    assert tied.lm_head.weight is tied.wte.weight


def test_initialisation_follows_gpt2():
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=64, vocab_size=1000), LayerNorm)
    model.init_weights(0)
    assert abs(model.wte.weight.std().item() - 0.02) < 1e-3
    assert abs(model.blocks[0].mlp.c_proj.weight.std().item() - 0.02 / (2 * 4) ** 0.5) < 1e-3
    assert torch.all(model.blocks[0].attn.c_attn.bias == 0)
    assert torch.all(model.blocks[0].ln_1.weight == 1) and torch.all(model.blocks[0].ln_1.bias == 0)


def test_a_norm_takes_settings_per_site_kind_and_only_the_norms_differ():
    """DyT's alpha_init per site kind (norm.sites: attention ln_1, mlp ln_2, final ln_f; the layer's where a site
    kind says nothing): the model of each setting has the weights of every other parameter of the default's."""
    sites = ["norm=dyt", "norm.layer.alpha_init=0.2", "norm.sites.attention.alpha_init=0.8"]
    model, default = build_model(compose_config("train", sites)), build_model(compose_config("train", ["norm=dyt"]))
    for m in (model, default):
        m.init_weights(seed=3)
    alphas = [(b.ln_1.alpha.item(), b.ln_2.alpha.item()) for b in model.blocks]
    assert alphas == [(pytest.approx(0.8), pytest.approx(0.2))] * model.config.n_layer
    assert model.ln_f.alpha.item() == pytest.approx(0.2)
    assert all(b.ln_1.alpha.item() == b.ln_2.alpha.item() == 0.5 for b in default.blocks)
    different = {n for n, p in model.state_dict().items() if not torch.equal(p, default.state_dict()[n])}
    assert different == {f"blocks.{i}.ln_{k}.alpha" for i in range(model.config.n_layer) for k in (1, 2)} | {
        "ln_f.alpha"}
    with pytest.raises(ConfigError, match="unknown norm site kind 'head': the kinds are attention, mlp, final"):
        GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=50), LayerNorm, {"head": RMSNorm})
