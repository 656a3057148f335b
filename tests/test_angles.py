"""The angle statistics: checked against known geometry, batching and DDP merging, and the hooks of
every supported architecture (tiny random models built from their configs, no downloads)."""

import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from conftest import run_cli
from normlab.model.gpt import GPT, GPTConfig
from normlab.model.norms import LayerNorm, RMSNorm
from normlab.probe.hooks import AngleProbe, measure, random_directions
from normlab.probe.sites import LAYOUTS, NormSite, norm_sites
from normlab.probe.table import POSITIONS, read_csv


def identity_probe(d):
    """Statistics of raw vectors: a 'norm' that is the identity, watched by the real hooks."""
    module = nn.Identity()
    return module, [NormSite(0, "attn_norm", module)]


def orthogonal_to_1(model: GPT) -> GPT:
    """Everything that writes to the residual stream writes vectors orthogonal to 1: so do the norms' inputs."""
    with torch.no_grad():
        for emb in (model.wte, model.wpe):
            emb.weight -= emb.weight.mean(1, keepdim=True)
        for block in model.blocks:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight -= proj.weight.mean(0, keepdim=True)
                proj.bias -= proj.bias.mean()
    return model


def records_of(stats, site="attn_norm.input", position="all"):
    return {r["reference"]: r for r in stats.records(0) if r["site"] == site and r["position"] == position}


def test_random_gaussian_vectors_match_the_null_model():
    d, n = 256, 40_000
    module, sites = identity_probe(d)
    x = torch.randn(n // 100, 100, d, generator=torch.Generator().manual_seed(0))
    stats = measure(lambda ids, mask: module(ids), sites, d, [(x, None)])
    null_std = math.degrees(1 / math.sqrt(d))
    for reference, r in records_of(stats).items():
        assert r["count"] == n and r["null_std_deg"] == pytest.approx(null_std)
        assert abs(r["mean_deg"] - 90) < 4 * null_std / math.sqrt(n), reference  # sampling error of the mean
        assert r["std_deg"] == pytest.approx(null_std, rel=0.03), reference  # (180/pi)/sqrt(d), large-d limit
        assert r["mean_cos2"] == pytest.approx(1 / d, rel=0.05)
        assert r["mean_norm"] == pytest.approx(math.sqrt(d), rel=0.01)
        histogram = [int(c) for c in r["histogram"].split()]
        assert len(histogram) == 180 and sum(histogram) == n
        assert sum(histogram[int(90 - null_std) : int(90 + null_std) + 1]) > 0.6 * n  # one std either side


def test_the_percentile_null_places_the_mean_angle_to_1_among_random_directions():
    """Against a float64 recomputation with the same seeded directions; a component planted along 1 puts 1 at the
    0th percentile (its mean angle is smaller than every random direction's); masked tokens are left out."""
    d, directions = 32, 50
    module, sites = identity_probe(d)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 20, d, generator=gen) * torch.linspace(0.2, 3, d)  # anisotropic: random means spread
    mask = torch.rand(6, 20, generator=gen) > 0.2
    for planted in (0.0, 2.0):
        inputs = x + planted
        stats = measure(lambda ids, m: module(ids), sites, d, [(inputs, mask)], null_directions=directions)
        for position, selected in (("all", mask), ("first", mask & (torch.arange(20) == 0)),
                                   ("rest", mask & (torch.arange(20) > 0))):
            v = inputs[selected].double()
            random_means = torch.rad2deg(torch.acos((v @ random_directions(directions, d).T) / v.norm(dim=1)[:, None]))
            random_means = random_means.mean(0)
            r = records_of(stats, position=position)["uniform"]
            assert r["null_directions"] == directions
            assert r["null_random_mean_deg"] == pytest.approx(random_means.mean().item(), abs=1e-4)
            assert r["null_random_std_deg"] == pytest.approx(random_means.std().item(), abs=1e-4)
            assert r["null_percentile"] == pytest.approx(100 * (random_means < r["mean_deg"]).double().mean().item())
            assert r["sem_deg"] == pytest.approx(r["std_deg"] / math.sqrt(r["count"]))
        if planted:
            assert records_of(stats)["uniform"]["null_percentile"] == 0
    rotation = [r for r in stats.records(0) if r["site"].endswith(".rotation")]
    assert rotation and all(r["null_percentile"] == "" for r in rotation)  # no null for the input-output angle


def test_wandb_panels_come_in_sections_of_one_question_each():
    from normlab.training.callbacks.angles import wandb_scalars

    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=300), RMSNorm)
    model.init_weights(0)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    stats = measure(lambda i, m: model.hidden(i), norm_sites(model, "normlab"), 32, [(ids, None)], null_directions=4)
    scalars = wandb_scalars(stats.records(0))
    sections = {}
    for key in scalars:
        section, panel = key.split("/")
        sections.setdefault(section, []).append(panel)
    panels = ["L00.attn_norm", "L00.mlp_norm", "L01.attn_norm", "L01.mlp_norm", "L02.final_norm"]
    assert sections == {name: panels for name in [
        *(f"angles-{ref}-{io}" for io in ("input", "output") for ref in ("uniform", "random_a", "random_b")),
        "angles-rotation", "share-along-1-input", "percentile-1-input"]}
    (first,) = [r for r in stats.records(0) if (r["layer"], r["site"], r["reference"], r["position"]) == (
        0, "attn_norm.input", "uniform", "all")]
    assert scalars["angles-uniform-input/L00.attn_norm"] == first["mean_deg"]
    assert scalars["share-along-1-input/L00.attn_norm"] == first["mean_cos2"]


def test_wandb_gets_the_reports_per_layer_figure_of_each_probe(tmp_path):
    from normlab.training.callbacks.angles import layer_figure, wandb_table

    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=300), RMSNorm)
    model.init_weights(0)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    for null_directions in (0, 4):
        stats = measure(lambda i, m: model.hidden(i), norm_sites(model, "normlab"), 32, [(ids, None)],
                        null_directions=null_directions)
        identity = {"run": "tiny-rmsnorm-seed0", "model": "tiny", "norm": "rmsnorm", "seed": 0, "source": "training"}
        records = stats.records(10, identity)
        name = layer_figure(records, tmp_path)
        assert (tmp_path / name).stat().st_size > 10_000  # a 300-dpi PNG (and its PDF beside it)
        columns, data = wandb_table(records)  # the per-direction means stay in angles.csv
        assert "null_random_means_deg" not in columns and columns[-1] == "histogram" and len(data) == len(records)
        assert (null_directions > 0) == any(r.get("null_random_means_deg") for r in records)


@pytest.mark.parametrize("t", [0.0, 0.1, 1.0, -2.0])
def test_planted_component_along_uniform_gives_the_analytic_angle(t):
    d = 128
    module, sites = identity_probe(d)
    u = torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    u -= u.mean()  # orthogonal to 1
    u *= 3.0 / u.norm()
    x = (u + t).float().expand(4, 10, d).clone()
    stats = measure(lambda ids, mask: module(ids), sites, d, [(x, None)])
    r = records_of(stats)["uniform"]
    expected = math.degrees(math.atan2(3.0, t * math.sqrt(d)))
    assert r["mean_deg"] == pytest.approx(expected, abs=1e-3) and r["std_deg"] < 1e-3
    assert r["min_deg"] == pytest.approx(expected, abs=1e-3) and r["max_deg"] == pytest.approx(expected, abs=1e-3)
    assert r["mean_cos2"] == pytest.approx(t * t * d / (t * t * d + 9.0), abs=1e-6)


@pytest.mark.parametrize("degrees", [0.01, 0.5, 10.0, 120.0])
def test_rotation_from_norm_input_to_output_is_the_angle_between_them(degrees):
    d = 256
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, d, dtype=torch.float64, generator=gen)
    a, b = a / a.norm(), b - (b @ a) * a / (a @ a)
    b /= b.norm()
    turned = math.cos(math.radians(degrees)) * a + math.sin(math.radians(degrees)) * b
    module = nn.Module()
    module.forward = lambda x: 7.0 * turned.float().expand_as(x)  # output at `degrees` from the input, rescaled
    x = (3.0 * a).float().expand(2, 5, d).clone()
    stats = measure(lambda ids, mask: module(ids), [NormSite(0, "attn_norm", module)], d, [(x, None)])
    r = records_of(stats, "attn_norm.rotation")["input"]
    assert r["mean_deg"] == pytest.approx(degrees, rel=1e-3, abs=2e-4) and r["count"] == 10


@pytest.mark.parametrize("norm", [LayerNorm, RMSNorm])
def test_mean_centred_writing_weights_put_every_norm_input_at_exactly_90_degrees(norm):
    model = GPT(GPTConfig(n_layer=3, n_head=4, n_embd=64, block_size=32, vocab_size=500), norm)
    model.init_weights(0)
    orthogonal_to_1(model)
    ids = torch.randint(0, 500, (4, 32), generator=torch.Generator().manual_seed(2))
    stats = measure(lambda i, m: model.hidden(i), norm_sites(model, "normlab"), 64, [(ids, None)])
    inputs = [r for r in stats.records(0) if r["site"].endswith(".input") and r["reference"] == "uniform"]
    assert len(inputs) == len(POSITIONS) * (2 * 3 + 1)
    for r in inputs:
        assert abs(r["min_deg"] - 90) < 1e-3 and abs(r["max_deg"] - 90) < 1e-3, r


def test_batched_statistics_equal_one_pass():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=300), LayerNorm)
    model.init_weights(3)
    ids = torch.randint(0, 300, (12, 16), generator=torch.Generator().manual_seed(4))
    forward = lambda i, m: model.hidden(i)  # noqa: E731
    sites = norm_sites(model, "normlab")
    one_pass = measure(forward, sites, 32, [(ids, None)])
    batched = measure(forward, sites, 32, [(b, None) for b in ids.split(5)])
    merged = measure(forward, sites, 32, [(ids[:7], None)]).merge(measure(forward, sites, 32, [(ids[7:], None)]))
    # The merge itself is exact (float64); the per-token angles come from float32 forward passes whose last
    # bits depend on the batch shape, hence the 1e-6 relative tolerance.
    for other in (batched, merged):
        for a, b in zip(one_pass.records(0), other.records(0), strict=True):
            assert a["count"] == b["count"]
            for key in ("mean_deg", "std_deg", "min_deg", "max_deg", "mean_norm", "mean_cos2"):
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-6), key
        assert torch.equal(one_pass.hist, other.hist)


def test_padding_is_masked_and_first_positions_are_reported_separately():
    d = 16
    module, sites = identity_probe(d)
    x = torch.randn(3, 5, d)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    x[~mask] = 1.0  # padding: exactly along 1, would give 0 degrees if counted
    stats = measure(lambda ids, m: module(ids), sites, d, [(x, mask)])
    assert records_of(stats)["uniform"]["count"] == 10 and records_of(stats)["uniform"]["min_deg"] > 1
    assert records_of(stats, position="first")["uniform"]["count"] == 3


def test_first_is_the_first_token_of_each_document_and_rest_every_other():
    """With the separator given (GPT-2's EOT in normlab's probes), position first counts the tokens that follow it,
    wherever in a window they lie, and rest all the others; padding in neither."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=300), LayerNorm)
    model.init_weights(0)
    ids = torch.randint(8, 300, (3, 16), generator=torch.Generator().manual_seed(1))
    ids[0, [3, 9]] = 7  # documents start at 4 and 10 of window 0, at 1 of window 2; the 7 at its end starts none
    ids[2, [0, 15]] = 7
    mask = torch.ones(3, 16, dtype=torch.bool)
    mask[1, 12:] = False
    stats = measure(lambda i, m: model.hidden(i), norm_sites(model, "normlab"), 32, [(ids, mask)], separator=7)
    counts = {p: records_of(stats, position=p)["uniform"]["count"] for p in POSITIONS}
    assert counts == {"all": 44, "first": 3, "rest": 41}
    hidden = {}
    handle = model.blocks[0].ln_1.register_forward_hook(lambda m, a, o: hidden.update(x=a[0]))
    with torch.no_grad():
        model.hidden(ids)
    handle.remove()
    starts = hidden["x"][[0, 0, 2], [4, 10, 1]].double()
    expected = torch.rad2deg(torch.acos(starts.sum(1) / (starts.norm(dim=1) * math.sqrt(32)))).mean()
    assert records_of(stats, position="first")["uniform"]["mean_deg"] == pytest.approx(expected.item(), abs=1e-4)


def test_normlab_angles_holds_one_model_in_memory_at_a_time(tmp_path):
    """A paper_1b run has 15 checkpoints of 4 GB: each model is let go before the next one loads."""
    import gc
    import weakref

    from normlab.study.angles import Analysis, measure_analysis

    alive = []

    def load():
        gc.collect()
        assert not [ref for ref in alive if ref() is not None], "the previous checkpoint's model is still held"
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=300), LayerNorm)
        model.init_weights(len(alive))
        alive.append(weakref.ref(model))
        return model

    identity = {"run": "r", "model": "m", "norm": "layernorm", "seed": 0, "source": "s"}
    windows = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    analysis = Analysis(tmp_path, "normlab", [(step, load, identity) for step in (0, 1, 2)], windows, [], 7)
    rows = measure_analysis(analysis, "cpu", batch_size=2)
    assert len(alive) == 3 and sorted({r["step"] for r in rows}) == [0, 1, 2]


def test_a_bfloat16_model_is_measured_with_float64_statistics():
    """dtype=bfloat16 (a 6-8B model on one 80 GB GPU): the weights and activations in bf16, the statistics still
    float64, the angles those of the float32 model to bf16 precision."""
    from normlab.training.loader import DTYPES

    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=300), LayerNorm)
    model.init_weights(0)
    ids = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for dtype in ("float32", "bfloat16"):
        model.to(DTYPES[dtype])
        stats = measure(lambda i, m: model.hidden(i), norm_sites(model, "normlab"), 32, [(ids, None)],
                        null_directions=4)
        assert stats.mean.dtype == stats.null_sum.dtype == torch.float64
        results[dtype] = stats.records(0)
    for full, half in zip(results["float32"], results["bfloat16"], strict=True):
        assert full["count"] == half["count"] and half["mean_deg"] == pytest.approx(full["mean_deg"], abs=1.0)


DDP_SCRIPT = """
import sys, torch, torch.distributed as dist
from normlab.probe.hooks import measure
from normlab.probe.sites import norm_sites
from normlab.model.gpt import GPT, GPTConfig
from normlab.model.norms import RMSNorm
rank, world, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{path}.rendezvous", rank=rank, world_size=world)
model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=300), RMSNorm)
model.init_weights(3)
ids = torch.randint(0, 300, (10, 16), generator=torch.Generator().manual_seed(4))
batches = [(b, None) for b in ids[rank::world].split(2)]
stats = measure(lambda i, m: model.hidden(i), norm_sites(model, "normlab"), 32, batches)
if rank == 0:
    torch.save(stats.records(0), path)
dist.destroy_process_group()
"""


def test_ddp_ranks_merge_to_the_single_process_result(tmp_path):
    out = tmp_path / "records.pt"
    procs = [
        subprocess.Popen([sys.executable, "-c", DDP_SCRIPT, str(r), "2", str(out)], env={**os.environ})
        for r in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=300), RMSNorm)
    model.init_weights(3)
    ids = torch.randint(0, 300, (10, 16), generator=torch.Generator().manual_seed(4))
    # one process over the same micro-batches (float32 forward passes of other shapes differ in the last bits)
    same_batches = [(b, None) for rank in range(2) for b in ids[rank::2].split(2)]
    single = measure(lambda i, m: model.hidden(i), norm_sites(model, "normlab"), 32, same_batches).records(0)
    for a, b in zip(single, torch.load(out, weights_only=False), strict=True):
        assert a["count"] == b["count"] and a["max_deg"] == b["max_deg"]
        assert a["mean_deg"] == pytest.approx(b["mean_deg"], rel=1e-9) and a["std_deg"] == pytest.approx(
            b["std_deg"], rel=1e-9
        )


# -- Hugging Face architectures: hooks on the right modules


def tiny_hf(model_type):
    transformers = pytest.importorskip("transformers")
    # importing them registers normlab-export's model types with AutoModelForCausalLM
    from normlab.interop.hf_dyt_gpt2 import NormlabDyTGPT2Config
    from normlab.interop.hf_rmsnorm_gpt2 import NormlabRMSGPT2Config
    common = dict(vocab_size=50257, num_hidden_layers=2, num_attention_heads=4)
    configs = {
        "gpt2": transformers.GPT2Config(vocab_size=50257, n_layer=2, n_head=4, n_embd=32, n_positions=64),
        "gpt_neo": transformers.GPTNeoConfig(
            vocab_size=50257,
            num_layers=2,
            num_heads=4,
            hidden_size=32,
            attention_types=[[["global", "local"], 1]],
            max_position_embeddings=64,
        ),
        "gptj": transformers.GPTJConfig(
            vocab_size=50257, n_layer=2, n_head=4, n_embd=32, rotary_dim=4, n_positions=64
        ),
        "gpt_neox": transformers.GPTNeoXConfig(
            **common, hidden_size=32, intermediate_size=64, max_position_embeddings=64
        ),
        "llama": transformers.LlamaConfig(**common, hidden_size=32, intermediate_size=64, max_position_embeddings=64),
        "normlab_rms_gpt2": NormlabRMSGPT2Config(vocab_size=50257, n_layer=2, n_head=4, n_embd=32, n_positions=64),
        "normlab_dyt_gpt2": NormlabDyTGPT2Config(vocab_size=50257, n_layer=2, n_head=4, n_embd=32, n_positions=64),
    }
    torch.manual_seed(0)
    if model_type == "normlab_gpt2":  # normlab-export's GPT-2 of any other norm: its classes are written per norm
        from normlab.interop.export import hf_model
        from normlab.model.gpt import GPT, GPTConfig
        from normlab.model.norms import DyT

        model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=64), DyT)
        model.init_weights(0)
        return hf_model(model, {"run": "tiny"}).eval()
    return transformers.AutoModelForCausalLM.from_config(configs[model_type]).eval()


@pytest.mark.parametrize("model_type", [k for k in LAYOUTS if k != "normlab"])
def test_hooks_land_on_the_norm_modules_of_every_architecture(model_type):
    model = tiny_hf(model_type)
    sites = norm_sites(model, model_type)
    norm_classes = {type(s.module).__name__ for s in sites}
    other_norms = {"llama": "LlamaRMSNorm", "normlab_rms_gpt2": "RMSNorm", "normlab_dyt_gpt2": "DyT",
                   "normlab_gpt2": "DyT"}
    assert norm_classes == {other_norms.get(model_type, "LayerNorm")}
    roles = [(s.layer, s.role) for s in sites]
    per_block = ["attn_norm"] if model_type == "gptj" else ["attn_norm", "mlp_norm"]
    assert roles == [(i, r) for i in range(2) for r in per_block] + [(2, "final_norm")]
    # the hooked input of block l's first norm is the residual stream entering block l
    ids = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    stats = measure(
        lambda i, m: model.base_model(input_ids=i, attention_mask=m),
        sites,
        32,
        [(ids, torch.ones_like(ids, dtype=torch.bool))],
    )
    probe = AngleProbe(sites, 32)
    for layer in range(2):
        direct = torch.rad2deg(
            torch.acos(
                hidden[layer].flatten(0, 1)
                @ probe.references[0]
                / (hidden[layer].flatten(0, 1).norm(dim=1) * math.sqrt(32))
            )
        )
        row = next(
            r
            for r in stats.records(0)
            if r["layer"] == layer
            and r["site"] == "attn_norm.input"
            and r["reference"] == "uniform"
            and r["position"] == "all"
        )
        assert row["mean_deg"] == pytest.approx(direct.double().mean().item(), abs=1e-4)
    if model_type == "gpt_neox":  # parallel residual: both norms read the same h
        rows = {
            (r["layer"], r["site"]): r["mean_deg"]
            for r in stats.records(0)
            if r["reference"] == "uniform" and r["position"] == "all"
        }
        assert rows[(0, "attn_norm.input")] == pytest.approx(rows[(0, "mlp_norm.input")], abs=1e-9)


def test_normlab_angles_reads_a_local_hugging_face_directory(prepared, tmp_path):
    model = tiny_hf("gpt2")
    model.save_pretrained(tmp_path / "tiny-gpt2")
    result = run_cli(  # relative paths: from the working directory
        "normlab-angles", "model_path=tiny-gpt2", "probe.tokens=2048", "seq_len=64", "out=angles.csv", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("wrote angles.csv (1 checkpoint, 2,048 probe tokens)")
    rows = read_csv(tmp_path / "angles.csv")
    assert {r["site"] for r in rows} >= {
        "attn_norm.input",
        "mlp_norm.output",
        "final_norm.input",
        "attn_norm.rotation",
    }
    assert {r["count"] for r in rows if r["position"] == "all"} == {2048}
