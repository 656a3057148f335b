"""normlab-ablate, where the answer is known: norm inputs orthogonal to 1 give a delta of 0 whichever way the norm is
ablated, a large component along 1 a large one, LayerNorm with its centring removed is RMSNorm (and the converse),
DyT's input centred before its tanh; the probe windows drawn across the whole split, the same for every model; the
bootstrap interval, by windows and by blocks, on planted deltas whose interval is known; Hugging Face GPT-2 and
Llama; and the command itself, once."""

import csv
import re
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import NORM_CONFIGS, compose_config, run_cli
from normlab.data.corpus import draw_windows
from normlab.model.gpt import GPT, GPTConfig
from normlab.model.norms import DyT, LayerNorm, RMSNorm, traits, without_centring
from normlab.probe.sites import NormSite, norm_sites
from normlab.probe.table import AnalysisError
from normlab.study.ablate import (
    CSV_COLUMNS,
    EARLIER_COLUMNS,
    LOSS_CHUNK,
    ablate,
    ablation,
    ablation_rows,
    bootstrap_interval,
    losses_of,
    main,
    plan,
    random_directions,
    window_losses,
)
from normlab.training.pipeline import build_model
from normlab.training.rundir.checkpoints import write_checkpoint
from test_angles import orthogonal_to_1

VOCAB = 200


def norm_factory(name: str):
    """The layers of the norm config `name` as a model builds them (conf/norm/<name>.yaml's norm.layer)."""
    return instantiate(compose_config("train", [f"norm={name}"]).norm.layer)


def tiny(norm, seed=0) -> GPT:
    """A random tiny GPT with sharp logits and norm gains and biases away from 1 and 0 (so that they matter)."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=VOCAB), norm)
    model.init_weights(seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.lm_head.weight *= 50
        for site in norm_sites(model, "normlab"):
            site.module.weight.copy_(1 + 0.3 * torch.randn(32, generator=gen))
            if site.module.bias is not None:
                site.module.bias.copy_(0.3 * torch.randn(32, generator=gen))
    return model.eval()


@torch.no_grad()
def greedy_windows(forward, vocab=VOCAB, n=16, seq_len=16) -> torch.Tensor:
    """Windows that the model itself writes (random first token, then its argmax): it predicts them well, so
    whatever changes its predictions raises the loss."""
    ids = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(1))
    while ids.shape[1] < seq_len:
        ids = torch.cat([ids, forward(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def by_site(rows) -> dict:
    return {r["site"]: r for r in rows}


@pytest.mark.parametrize("norm", NORM_CONFIGS)
def test_norm_inputs_orthogonal_to_1_give_delta_0_and_a_planted_component_a_large_one(norm):
    model = orthogonal_to_1(tiny(norm_factory(norm)))
    centres = traits(model.ln_f).centres
    windows = greedy_windows(model)
    rows = by_site(ablation_rows(model, "normlab", windows, batch_size=8, resamples=200))
    assert list(rows) == [f"layer{i:02d}.{r}" for i in range(2) for r in ("attn_norm", "mlp_norm")] + [
        "layer02.final_norm", "all"]
    assert {r["ablation"] for r in rows.values()} == {"uncentred" if centres else "centred"}
    for site, r in rows.items():
        assert abs(r["delta"]) < 1e-5 and abs(r["ci_low"]) < 1e-5 and abs(r["ci_high"]) < 1e-5, site
        assert r["share_along_1"] < 1e-12 and r["d"] == 32, site
    with torch.no_grad():
        model.wte.weight += 3.0  # a component along 1 that dwarfs the rest (|e| ~ 0.1 sqrt(32))
    windows = greedy_windows(model)
    rows = by_site(ablation_rows(model, "normlab", windows, batch_size=8, resamples=200))
    # Uncentred, LayerNorm's first norm feeds attention a vector along 1, the same for every token; the RMSNorm
    # model's attention and MLP do little in a random model, but its output is along 1 until its final norm.
    for site in ("layer00.attn_norm" if centres else "layer02.final_norm", "all"):
        r = rows[site]
        assert r["share_along_1"] > 0.99, site
        assert r["delta"] > 0.05 and r["ci_low"] > 0 and r["ablated_loss"] == pytest.approx(r["loss"] + r["delta"]), r


def test_dyt_ablated_is_dyt_of_the_centred_input():
    """The centring goes before the tanh: gamma * tanh(alpha (x - mean(x) 1)) + beta, by hand."""
    dyt = DyT(8, alpha_init=0.7)
    with torch.no_grad():
        dyt.weight.copy_(torch.linspace(0.5, 2.0, 8))
        dyt.bias.copy_(torch.linspace(-1.0, 1.0, 8))
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0)) + 2.0
    site = NormSite(0, "attn_norm", dyt)
    assert ablation(site) == "centred"
    with ExitStack() as stack:
        ablate(stack, site, "centred")
        ablated = dyt(x)
    centred = x - x.mean(-1, keepdim=True)
    assert torch.allclose(ablated, torch.tanh(0.7 * centred) * dyt.weight + dyt.bias, atol=1e-6)
    assert torch.allclose(dyt(x), torch.tanh(0.7 * x) * dyt.weight + dyt.bias, atol=1e-6)  # the hook is gone


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_uncentred_everywhere_is_rmsnorm_and_rmsnorm_centred_everywhere_is_layernorm(bias):
    ln, rms = tiny(partial(LayerNorm, bias=bias), seed=3), tiny(partial(RMSNorm, bias=bias), seed=3)
    assert torch.equal(ln.lm_head.weight, rms.lm_head.weight) and torch.equal(ln.ln_f.weight, rms.ln_f.weight)
    windows = torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(2))
    ln_all = by_site(ablation_rows(ln, "normlab", windows, resamples=10))["all"]
    rms_all = by_site(ablation_rows(rms, "normlab", windows, resamples=10))["all"]
    assert abs(ln_all["delta"]) > 0.01  # a generic model: the centring matters
    assert ln_all["ablated_loss"] == pytest.approx(rms_all["loss"], abs=1e-5)
    assert rms_all["ablated_loss"] == pytest.approx(ln_all["loss"], abs=1e-5)
    assert ln_all["delta"] == pytest.approx(-rms_all["delta"], abs=1e-5)


def test_a_normlab_models_loss_in_chunks_of_tokens_equals_the_loss_of_its_whole_logits():
    """GPT-2's vocabulary, windows whose 3 x 99 scored tokens are no multiple of LOSS_CHUNK: each window's loss from
    the head in chunks equals the one from the whole B x T x vocab logits, and the model's own mean loss."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=100, vocab_size=50257), RMSNorm).eval()
    ids = torch.randint(50257, (3, 100))
    assert (3 * 99) % LOSS_CHUNK
    with torch.no_grad():
        chunked, whole = losses_of(model, "normlab")(ids), window_losses(model(ids), ids)
        assert torch.allclose(chunked, whole, rtol=0, atol=1e-6)
        assert chunked.mean().item() == pytest.approx(model(ids[:, :-1], ids[:, 1:]).item(), abs=1e-5)


def test_bootstrap_interval_known_answers():
    # two windows with deltas 0 and 1: resampled means 0, 1/2, 1 with chances 1/4, 1/2, 1/4, so 0 and 1 bound 95%
    low, high = bootstrap_interval(torch.tensor([[0.0, 1.0], [2.0, 2.0]]), 2000, seed=0)
    assert low.tolist() == [0.0, 2.0] and high.tolist() == [1.0, 2.0]
    low, high = bootstrap_interval(torch.tensor([[0.25]]), 50, seed=0)  # one window: the interval is that delta
    assert low.item() == high.item() == 0.25
    gen = torch.Generator().manual_seed(0)
    widths = []
    for windows in (20, 2000):
        deltas = 0.3 + torch.randn(1, windows, generator=gen, dtype=torch.float64)
        low, high = bootstrap_interval(deltas, 1000, seed=1)
        assert low < deltas.mean() < high
        assert torch.equal(torch.stack([low, high]), torch.stack(bootstrap_interval(deltas, 1000, seed=1)))  # seeded
        widths.append((high - low).item())
    assert widths[1] < widths[0] / 5  # ~ 1/sqrt(windows): 10x narrower
    assert widths[1] == pytest.approx(2 * 1.96 / 2000**0.5, rel=0.15)


def test_block_bootstrap_known_answers():
    # blocks {0, 0} and {1}: two blocks drawn, means 0 (AA), 1/3 (AB, BA) and 1 (BB) with chances 1/4, 1/2, 1/4
    deltas, blocks = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([7, 7, 9])
    low, high = bootstrap_interval(deltas, 4000, seed=0, units=blocks)
    assert (low.item(), high.item()) == (0.0, 1.0)
    deltas = torch.randn(3, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    by_window = bootstrap_interval(deltas, 500, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(by_window, bootstrap_interval(deltas, 500, 2, torch.arange(50))))


def planted_blocks(between: float, within: float, datasets=400, blocks=40, per_block=10) -> torch.Tensor:
    """[datasets, blocks * per_block] deltas of true mean 0: a block effect of sd `between` shared by the windows of
    a block, plus independent noise of sd `within`."""
    gen = torch.Generator().manual_seed(3)
    effect = between * torch.randn(datasets, blocks, 1, generator=gen, dtype=torch.float64)
    noise = within * torch.randn(datasets, blocks, per_block, generator=gen, dtype=torch.float64)
    return (effect + noise).flatten(1)


def test_block_bootstrap_covers_correlated_windows_where_the_window_bootstrap_is_too_narrow():
    """Windows correlated within blocks (the sd of a block's effect 10x the sd within it): the sd of the mean is
    sqrt(1/40 + 0.01/400) = 0.158, not the 0.050 that 400 independent windows would give. Each row is one planted
    data set: the share of the 400 whose interval holds the true mean 0 is the coverage."""
    blocks = torch.arange(400) // 10
    deltas = planted_blocks(between=1.0, within=0.1)
    coverage, width = {}, {}
    for unit, units in (("window", None), ("block", blocks)):
        low, high = bootstrap_interval(deltas, 1000, seed=1, units=units)
        coverage[unit], width[unit] = ((low < 0) & (0 < high)).double().mean().item(), (high - low).mean().item()
    sd = (1 / 40 + 0.01 / 400) ** 0.5
    assert width["block"] == pytest.approx(2 * 1.96 * sd, rel=0.1)  # the percentile bootstrap runs a bit narrow
    assert width["window"] == pytest.approx(2 * 1.96 * (1.01 / 400) ** 0.5, rel=0.1)
    assert coverage["block"] > 0.9 and coverage["window"] < 0.6  # P(|Z| < 1.96 x 0.050 / 0.158) = 0.46


def test_block_bootstrap_on_independent_windows_is_the_window_bootstrap():
    blocks = torch.arange(400) // 10
    deltas = planted_blocks(between=0.0, within=1.0)
    (low_w, high_w), (low_b, high_b) = bootstrap_interval(deltas, 1000, 1), bootstrap_interval(deltas, 1000, 1, blocks)
    for low, high in ((low_w, high_w), (low_b, high_b)):
        assert (high - low).mean().item() == pytest.approx(2 * 1.96 / 400**0.5, rel=0.1)
        assert ((low < 0) & (0 < high)).double().mean().item() > 0.9


def test_an_unknown_norm_gets_its_input_centred_and_one_that_cannot_skip_its_centring_is_refused():
    """The ablation asks the norm what it is (norms.traits): a plain module is centred at its input, whatever its
    class; one that says it centres must give its output without the centring, or is refused in one line."""
    group = NormSite(3, "mlp_norm", torch.nn.GroupNorm(1, 8))
    assert ablation(group) == "centred"

    class Centring(torch.nn.Module):
        centres = True

        def forward(self, x):
            return x - x.mean(-1, keepdim=True)

    with pytest.raises(AnalysisError, match=r"^cannot ablate layer03.mlp_norm: Centring says it centres its input "
                                            "but has no without_centring"):
        ablation(NormSite(3, "mlp_norm", Centring()))
    Centring.without_centring = lambda self, x: x
    assert ablation(NormSite(3, "mlp_norm", Centring())) == "uncentred"


# -- Hugging Face models, built from their configs (no downloads)


def tiny_hf(model_type: str, planted: float, vocab: int = VOCAB):
    """Tiny GPT-2 (LayerNorm) or Llama (RMSNorm) whose residual writes are orthogonal to 1, plus `planted` 1 in every
    token embedding."""
    transformers = pytest.importorskip("transformers")
    if model_type == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_layer=2, n_head=4, n_embd=32, n_positions=64)
    else:
        config = transformers.LlamaConfig(vocab_size=vocab, num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
                                          intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        if model_type == "gpt2":  # Conv1D weights: [in, out]; the LM head is tied to wte
            embeddings = [model.transformer.wte, model.transformer.wpe]
            writes = [(m.weight, 1) for b in model.transformer.h for m in (b.attn.c_proj, b.mlp.c_proj)]
            writes += [(m.bias, 0) for b in model.transformer.h for m in (b.attn.c_proj, b.mlp.c_proj)]
        else:  # Linear weights: [out, in]; no biases, rotary positions
            embeddings = [model.model.embed_tokens]
            writes = [(m.weight, 0) for b in model.model.layers for m in (b.self_attn.o_proj, b.mlp.down_proj)]
        for emb in embeddings:
            emb.weight -= emb.weight.mean(1, keepdim=True)
        for weight, out_dim in writes:
            weight -= weight.mean(out_dim, keepdim=True)
        embeddings[0].weight += planted
        model.lm_head.weight *= 20
    return model


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_hugging_face_gpt2_and_llama(model_type):
    model = tiny_hf(model_type, planted=0.0)
    windows = greedy_windows(lambda ids: model(input_ids=ids).logits)
    rows = by_site(ablation_rows(model, model_type, windows, resamples=100))
    assert len(rows) == 2 * 2 + 2 and {r["ablation"] for r in rows.values()} == {
        "uncentred" if model_type == "gpt2" else "centred"}
    assert all(abs(r["delta"]) < 1e-5 and r["share_along_1"] < 1e-12 for r in rows.values()), rows
    model = tiny_hf(model_type, planted=3.0)
    windows = greedy_windows(lambda ids: model(input_ids=ids).logits)
    every = by_site(ablation_rows(model, model_type, windows, resamples=100))["all"]
    assert every["share_along_1"] > 0.99 and every["delta"] > 0.05 and every["ci_low"] > 0, every


# -- the command


def test_a_hugging_face_directory_measured_by_main(prepared, tmp_path, capsys):
    tiny_hf("gpt2", planted=0.0, vocab=50257).save_pretrained(tmp_path / "tiny-gpt2")  # no tokenizer: GPT-2 ids
    main(compose_config("ablate", [f"model_path={tmp_path / 'tiny-gpt2'}", "probe.tokens=256", "seq_len=32",
                                   "bootstrap=50", f"paths.output_dir={tmp_path}"]))
    out = tmp_path / "ablation" / tmp_path.name / "tiny-gpt2.csv"  # <folder>/<model>.csv
    blocks = len(torch.unique(draw_windows(88015 // 32, 8, seed=0) * 32 // 4096))  # 8 of the split's 2,750 windows
    assert capsys.readouterr().out.endswith(
        f"wrote {out} (26 rows, 8 windows in {blocks} blocks of 4096 tokens, 248 scored tokens)\n")
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["run"], r["model"], r["norm"], r["seed"], r["step"], r["ablation"], r["source"]) for r in rows} == {
        ("tiny-gpt2", "gpt2", "LayerNorm", "", "0", "uncentred", str((tmp_path / "tiny-gpt2").resolve()))}
    along_1 = [r for r in rows if r["direction"] == "1"]
    assert len(along_1) == 6 and all(abs(float(r["delta"])) < 1e-5 for r in along_1)  # its writes are orthogonal to 1
    assert max(abs(float(r["delta"])) for r in rows if r["direction"] != "1") > 1e-4  # not so to random directions


# -- the probe windows


def test_drawn_windows_are_seeded_sorted_distinct_and_spread_over_the_whole_split():
    drawn = draw_windows(1000, 100, seed=0)
    assert torch.equal(drawn, draw_windows(1000, 100, seed=0)) and not torch.equal(drawn, draw_windows(1000, 100, 1))
    assert len(drawn) == 100 and bool((drawn.diff() > 0).all())  # sorted, no slot twice: no two windows overlap
    assert drawn[0] < 50 and drawn[-1] > 950
    assert torch.bincount(drawn // 250).tolist() == pytest.approx([25] * 4, abs=8)  # each quarter of the split
    assert torch.equal(draw_windows(10, None, 0), torch.arange(10)) and torch.equal(draw_windows(10, 10, 3),
                                                                                    torch.arange(10))


def run_directory(folder: Path, norm: str, steps=(0,)) -> Path:
    """A run directory whose scheduled checkpoints of `steps` hold one random tiny model (2 layers, d=32, context
    32) of `norm`."""
    config = compose_config("train", ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
                                      f"norm={norm}"])
    model = build_model(config)
    model.init_weights(0)
    weights = {f"model.{k}": v for k, v in model.state_dict().items()}
    for step in steps:
        saved = {"config": OmegaConf.to_container(config, resolve=True)}
        checkpoint = {"state_dict": weights, "hyper_parameters": saved, "global_step": step}
        write_checkpoint(checkpoint, folder / "checkpoints" / f"step-{step:07d}.ckpt")
    return folder


def test_every_model_is_scored_on_the_same_windows_drawn_across_the_whole_split(prepared, tmp_path):
    """An LN run, an RMS run and a Hugging Face GPT-2 (GPT-2's ids: no tokenizer files) get the same 64 windows of
    the held-out split, spread from its beginning to its end, each the split's tokens where it starts."""
    tiny_hf("gpt2", planted=0.0, vocab=50257).save_pretrained(tmp_path / "tiny-gpt2")
    cfg = compose_config("ablate", ["model_path=x", "probe.tokens=2048", "seq_len=32", f"paths.output_dir={tmp_path}"])
    subjects = [plan(run_directory(tmp_path / "ln", "layernorm"), cfg), plan(run_directory(tmp_path / "rms", "rmsnorm"),
                cfg), plan(tmp_path / "tiny-gpt2", cfg)]
    split = np.fromfile(prepared / "val.bin", dtype=np.uint16).astype(np.int64)
    for subject in subjects:
        assert torch.equal(subject.windows, subjects[0].windows) and torch.equal(subject.starts, subjects[0].starts)
    windows, starts = subjects[0].windows, subjects[0].starts
    assert windows.shape == (64, 32) and bool((starts % 32 == 0).all()) and bool((starts.diff() >= 32).all())
    assert starts[0] < 0.05 * len(split) and starts[-1] > 0.95 * len(split)  # not the first 2,048 tokens
    assert all(torch.equal(w, torch.from_numpy(split[s : s + 32])) for w, s in zip(windows, starts.tolist()))
    other = plan(tmp_path / "ln", OmegaConf.merge(cfg, {"seed": 1}))
    assert not torch.equal(other.starts, starts)
    whole = plan(tmp_path / "ln", OmegaConf.merge(cfg, {"probe": {"tokens": None}}))
    assert torch.equal(whole.starts, torch.arange(len(split) // 32) * 32)  # null: every window of the split


# -- the null: the same ablation along random directions


def unit_1(width: int) -> torch.Tensor:
    return torch.full((width,), width ** -0.5)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "dyt"])
def test_the_nulls_operation_along_1_is_the_ablation_or_the_norm_as_trained(norm):
    """Along u = 1/sqrt(d) the null's operation is the ablation itself for a norm that does not centre (its input
    loses its mean), and the norm as trained for a centring one (its projection off 1 is the projection off u)."""
    model = tiny(norm_factory(norm), seed=2)
    site = norm_sites(model, "normlab")[1]
    kind = ablation(site)
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(0)) + 0.5
    with ExitStack() as stack:
        ablate(stack, site, kind, unit_1(32))
        along_u = site.module(x)
    with ExitStack() as stack:
        ablate(stack, site, kind)
        along_1 = site.module(x)
    expected = site.module(x) if kind == "uncentred" else along_1
    assert torch.allclose(along_u, expected, atol=1e-5)
    u = random_directions(32, 1, seed=0)[0]
    with ExitStack() as stack:
        ablate(stack, site, kind, u)
        random = site.module(x)
    off_u = x - (x @ u)[..., None] * u
    by_hand = (without_centring(site.module, off_u) if kind == "uncentred" else site.module(off_u))
    assert torch.allclose(random, by_hand, atol=1e-5)


def test_random_directions_are_unit_seeded_and_the_same_for_every_model_of_a_width():
    u = random_directions(64, 50, seed=0)
    assert u.shape == (50, 64) and torch.allclose(u.norm(dim=1), torch.ones(50), atol=1e-6)
    assert torch.equal(u, random_directions(64, 50, seed=0)) and not torch.equal(u, random_directions(64, 50, seed=1))
    assert abs(float((u @ unit_1(64)).mean())) < 0.05  # no pull toward 1: cos to 1 about N(0, 1/d)


def null_rows(rows) -> tuple[dict, list[float]]:
    """The along-1 row of every site at once, and the null's deltas."""
    (along_1,) = [r for r in rows if r["site"] == "all" and r["direction"] == "1"]
    return along_1, [r["delta"] for r in rows if r["direction"] != "1"]


def test_a_model_that_relies_on_1_puts_its_along_1_delta_at_the_top_of_the_null():
    """An RMS model whose residual stream is a large vector along 1 (every embedding +3 along each coordinate):
    removing that component at every norm changes everything, removing a random direction's almost nothing."""
    model = tiny(norm_factory("rmsnorm"))
    with torch.no_grad():
        model.wte.weight += 3.0
    rows = ablation_rows(model, "normlab", greedy_windows(model), resamples=50, null_directions=20)
    along_1, null = null_rows(rows)
    assert along_1["null_percentile"] == 100.0 and len(null) == 20
    assert along_1["delta"] > 0.05 and along_1["delta"] > 2 * max(abs(v) for v in null)


def test_a_model_indifferent_to_1_puts_its_along_1_delta_among_the_null():
    """RMS models with unit gains and isotropic random weights: nothing sets 1 apart from any other direction, so
    its delta is one more draw of the null's, and its percentile is uniform over models: over eight such models it
    averages near 50 and falls on both sides of the median."""
    percentiles = []
    for seed in range(8):
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=VOCAB), RMSNorm)
        model.init_weights(seed)
        with torch.no_grad():
            model.lm_head.weight *= 50
        rows = ablation_rows(model.eval(), "normlab", greedy_windows(model), resamples=20, null_directions=20,
                             seed=seed)
        percentiles.append(null_rows(rows)[0]["null_percentile"])
    assert 25 < np.mean(percentiles) < 75 and min(percentiles) < 50 < max(percentiles), percentiles


# -- the command, end to end


def test_normlab_ablate_writes_ablation_csv_in_a_run_directory(prepared, tmp_path):
    checkpoints = run_directory(tmp_path / "run", "rmsnorm_bias", steps=(0, 3, 5)) / "checkpoints"
    for name in ("step-0000005.ckpt", "step-0000005.ckpt.json"):
        (checkpoints / name).rename(checkpoints / name.replace("step-0000005", "last"))
    (checkpoints / "last.ckpt").write_bytes(b"torn")  # damaged: step 3 is the newest intact checkpoint
    (tmp_path / "run" / "ablation.csv").write_text(",".join(EARLIER_COLUMNS) + "\n")  # written before the unit was
    result = run_cli("normlab-ablate", "model_path=run", "probe.tokens=320", "seq_len=32", "bootstrap=100",
                     "null_directions=4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "warning: " in result.stderr and "last.ckpt holds 4 bytes" in result.stderr
    summary, wrote = result.stdout.strip().splitlines()[-2:]
    assert summary.startswith("run step 3 (rmsnorm_bias), inputs centred: delta at all norms ")
    assert re.search(r"nats/token \(percentile \d+ of 4 random directions' deltas, their median [+-]", summary)
    blocks = torch.unique(draw_windows(88015 // 32, 10, seed=0) * 32 // 4096)  # 10 of the split's 2,750 windows
    assert summary.endswith(f"; 95% intervals resample {len(blocks)} blocks of 4096 tokens") and len(blocks) > 5
    assert wrote == (f"wrote run/ablation.csv (10 rows, 10 windows in {len(blocks)} blocks of 4096 tokens, "
                     "310 scored tokens)")
    with open(tmp_path / "run" / "ablation.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == CSV_COLUMNS
    assert [r["site"] for r in rows] == ["layer00.attn_norm", "layer00.mlp_norm", "layer01.attn_norm",
                                         "layer01.mlp_norm", "layer02.final_norm"] + ["all"] * 5
    assert [r["direction"] for r in rows] == ["1"] * 6 + [f"random {k}" for k in range(4)]
    null = [float(r["delta"]) for r in rows[6:]]
    assert float(rows[5]["null_percentile"]) == 100 * sum(v < float(rows[5]["delta"]) for v in null) / 4
    assert {r["null_percentile"] for r in rows if r is not rows[5]} == {""}
    first = rows[0]
    assert (first["run"], first["model"], first["norm"], first["seed"], first["step"], first["layer"], first["role"],
            first["ablation"], first["windows"], first["tokens"], first["d"]) == (
        "run", "tiny", "rmsnorm_bias", "0", "3", "0", "attn_norm", "centred", "10", "310", "32")
    assert first["source"] == str((checkpoints / "step-0000003.ckpt").resolve())
    assert rows[-1]["layer"] == rows[-1]["role"] == ""
    assert {(r["resampling_unit"], r["resampling_units"]) for r in rows} == {
        ("blocks of 4096 tokens", str(len(blocks)))}
    for r in rows:
        assert float(r["ci_low"]) <= float(r["delta"]) <= float(r["ci_high"])
        assert float(r["ablated_loss"]) - float(r["loss"]) == pytest.approx(float(r["delta"]), abs=1e-9)
    # bad input: one line, exit 2, nothing written
    before = (tmp_path / "run" / "ablation.csv").read_bytes()
    bad = run_cli("normlab-ablate", "model_path=run", "seq_len=64", "out=other.csv", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "normlab-ablate: error: seq_len=64 is beyond the context of run (32 tokens, model.block_size): give at most 32"]
    assert not (tmp_path / "other.csv").exists() and (tmp_path / "run" / "ablation.csv").read_bytes() == before
    for override, line in (("block_tokens=16", "block_tokens=16 is shorter than a window of 32 tokens (seq_len): give "
                                               "block_tokens of at least 32"),
                           ("null_directions=-1", "null_directions=-1: give a whole number of random directions to "
                                                  "ablate along in place of 1 (0: no null)"),
                           ("probe.tokens=100000", "the probe split holds 2,750 windows of 32 tokens (88,000 tokens), "
                                                   "fewer than the 100,000 asked: lower probe.tokens, or "
                                                   "probe.tokens=null for all of them"),
                           ("probe.tokens=16", "probe.tokens=16 is less than one sequence of 32 tokens: give at least "
                                               "32, a smaller seq_len, or probe.tokens=null for the whole split")):
        with pytest.raises(AnalysisError) as error:
            main(compose_config("ablate", [f"model_path={tmp_path / 'run'}", "seq_len=32", f"out={tmp_path / 'o.csv'}",
                                           override]))
        assert str(error.value) == line
    assert not (tmp_path / "o.csv").exists()
