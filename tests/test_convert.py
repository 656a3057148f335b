"""normlab-convert and interop.convert: a pre-LN model turned into an RMSNorm one that computes the same function
(Jiang et al. 2023). Random normlab GPTs (embeddings of a clearly non-zero mean, random biases and gains; tied and
untied LM heads; with and without LayerNorm bias) give the same logits to float rounding, and the norm inputs of the
converted model sit at 90 degrees to 1 (the probe's hooks). Through the real commands on the session's LayerNorm run:
the converted run directory is read by normlab-angles, -ablate (the centring it adds changes no loss), -export and
-sample; an RMSNorm run, a missing path and an existing out are refused in one line, nothing written. A tiny random
Hugging Face GPT-2 directory converts to the same logits. Exact at inference only: with dropout (the same masks), or
after one AdamW step of both from the same gradients but their component along 1, the logits differ; dropout on the
attention weights alone keeps them equal."""

import csv
import hashlib
import json
import os
import shutil
import socket
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import EMBEDDED, compose_config, run_cli, run_of
from normlab.interop.convert import ConvertError, centred_weights, converted, main
from normlab.model.gpt import GPT, GPTConfig
from normlab.model.norms import DyT, LayerNorm, RMSNorm
from normlab.probe.hooks import measure
from normlab.probe.sites import norm_sites
from normlab.probe.table import read_csv, read_rows
from normlab.training.loader import load_model, read_checkpoint, saved_config
from normlab.training.rundir.claim import CLAIM_FILE, this_process

CHECKPOINT = "checkpoints/step-0000006.ckpt"  # the newest checkpoint of the session's runs (FAST_TRAIN)


def random_layernorm_gpt(tied: bool, bias: bool = True, dtype: torch.dtype = torch.float32,
                         dropout: float = 0.0) -> GPT:
    """A tiny LayerNorm GPT far from its initialisation: embeddings whose rows have a mean of about +0.5 (token) and
    -0.3 (position) against entries of 0.02, random biases around 0 and gains around 1, an LM head of entries around
    0.5."""
    config = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=97, tie_embeddings=tied,
                       dropout=dropout)
    model = GPT(config, partial(LayerNorm, bias=bias))
    model.init_weights(seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm gains around 1, every bias (c_proj's and the norms' included) around 0
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=generator))
        model.wte.weight.add_(0.5)
        model.wpe.weight.add_(-0.3)
        if not tied:
            model.lm_head.weight.mul_(25)  # entries of about 0.5, as the tied head's: logits of some size
    return model.to(dtype).eval()


def logits_of(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.float64, 1e-9)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_converted_model_gives_the_same_logits(tied, bias, dtype, tolerance):
    model = random_layernorm_gpt(tied, bias, dtype)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    twin = converted(model)
    assert twin.wte.weight.mean(1).abs().max() < 1e-6 < model.wte.weight.mean(1).abs().min()  # centred rows
    assert not twin.config.tie_embeddings and twin.lm_head.weight.data_ptr() != twin.wte.weight.data_ptr()
    torch.testing.assert_close(twin.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)  # the original matrix
    for site in norm_sites(twin, "normlab"):
        assert type(site.module) is RMSNorm and site.module.eps == 1e-5 and (site.module.bias is not None) == bias
    assert twin.wte.weight.dtype == dtype and not twin.training
    ids = torch.randint(0, 97, (3, 32), generator=torch.Generator().manual_seed(2))
    expected, logits = logits_of(model, ids), logits_of(twin, ids)
    assert expected.abs().max() > 1  # logits of some size: the tolerance is not met by small numbers alone
    torch.testing.assert_close(logits, expected, rtol=0, atol=tolerance)
    for name, tensor in model.state_dict().items():  # the source is left as it was
        assert torch.equal(tensor, before[name]), name


def share_along_1(model: GPT, ids: torch.Tensor) -> dict[tuple[int, str], float]:
    """The share of |x|^2 along 1, (x . 1)^2 / (d |x|^2), of the inputs of each norm, averaged over the tokens: the
    probe's mean_cos2 of the rows <norm>.input against the uniform vector."""
    stats = measure(lambda batch, mask: model(batch), norm_sites(model, "normlab"), model.config.n_embd,
                    [(ids, None)])
    return {(row["layer"], row["site"]): row["mean_cos2"] for row in stats.records(step=0)
            if row["site"].endswith(".input") and row["reference"] == "uniform" and row["position"] == "all"}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_converted_models_norm_inputs_are_orthogonal_to_1(tied):
    model = random_layernorm_gpt(tied)
    ids = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(3))
    original, twin = share_along_1(model, ids), share_along_1(converted(model), ids)
    assert original.keys() == twin.keys() and len(twin) == 5  # 2 layers x 2 norms, and the final norm
    assert min(original.values()) > 1e-3  # the uncentred stream: clearly along 1 (the null for random directions:
    assert max(twin.values()) < 1e-10  # 1/d = 0.016); centred: nothing along 1 but float32 rounding


def logits_under_dropout(model: GPT, ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Train-mode logits with the dropout masks drawn from `seed` (the global generator left as it was): two models of
    the same modules draw the same masks."""
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
        return model.train()(ids)


def gradients(model: GPT, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradient of the next-token loss on `ids` (train mode), by parameter name, left in the parameters' .grad for
    an optimizer step."""
    model.train().zero_grad()
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def along_1(grads: dict[str, torch.Tensor]) -> float:
    """The squared norm of what the conversion would remove from `grads`: their component along 1 in the vectors
    that write into the residual stream (embedding rows, c_proj columns and biases)."""
    centred_grads = centred_weights(grads)
    return sum(float((grad - centred_grads[name]).square().sum()) for name, grad in grads.items())


def test_the_conversion_is_exact_at_inference_only():
    """docs/convert.md, "Exact at inference only": in eval mode the converted model is the source; with dropout, or
    after one AdamW step of both, it is another model."""
    ids = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(6))
    source = random_layernorm_gpt(tied=False, dtype=torch.float64, dropout=0.1)
    twin = converted(source)
    expected = logits_of(source.eval(), ids)
    assert expected.abs().max() > 10
    torch.testing.assert_close(logits_of(twin.eval(), ids), expected, rtol=0, atol=1e-9)

    # Dropout scales each coordinate of a vector written into the stream by 0 or 1/(1 - p) on its own: it does not
    # commute with centring (mask(C x) != C mask(x)). The source's writers carry a mean along 1, which its LayerNorms
    # remove; the mask scatters that mean into directions no norm removes, and the converted stream, masked, is no
    # longer centred, so its RMSNorms no longer equal LayerNorms. The same masks (one seed, the same modules) give
    # logits that differ by 2.0-2.1 here. Dropout on the attention weights alone (the embeddings' and the residual
    # branches' off) keeps them equal, though it moves them by 0.35: c_proj still writes centred vectors.
    for seed in (0, 1):
        assert (logits_under_dropout(twin, ids, seed) - logits_under_dropout(source, ids, seed)).abs().max() > 1
    for dropout in (m for model in (source, twin) for m in model.modules() if isinstance(m, torch.nn.Dropout)):
        dropout.p = 0.0
    attention_dropped = logits_under_dropout(source, ids, seed=0)
    assert (attention_dropped - expected).abs().max() > 0.1
    torch.testing.assert_close(logits_under_dropout(twin, ids, seed=0), attention_dropped, rtol=0, atol=1e-9)

    # One training step, without dropout (the tiny preset's). The source's loss cannot see a shift of a writer along
    # 1 (every LayerNorm removes it), so its gradient has no component along 1 there; the converted model's RMSNorms
    # see it, so its gradient has one. Apart from that component the two gradients are the same: centring the
    # converted model's gives the source's. (Squared norms along 1: 4e-30 and 2.8, of 2,252 in all.)
    source = random_layernorm_gpt(tied=False, dtype=torch.float64)
    twin = converted(source)
    source_grads, twin_grads = gradients(source, ids), gradients(twin, ids)
    assert along_1(source_grads) < 1e-20 < 1e-2 < along_1(twin_grads)
    for name, grad in centred_weights(twin_grads).items():
        torch.testing.assert_close(grad, source_grads[name], rtol=0, atol=1e-9)
    # One step of a fresh AdamW for each (conf/optimizer/adamw.yaml at the tiny preset's lr 3e-3) on those gradients:
    # the converted model's step moves its writers along 1, its stream is no longer centred, and the two models part:
    # their logits differ by 0.34 after a single step.
    for model in (source, twin):
        instantiate(compose_config("train").optimizer)(model.parameters()).step()
    assert (logits_of(twin.eval(), ids) - logits_of(source.eval(), ids)).abs().max() > 0.1


@pytest.mark.parametrize("norm, message", [
    (RMSNorm, "run7 is already an RMSNorm model: nothing to convert"),
    (DyT, "run7 has DyT norms: only a LayerNorm model converts exactly into an RMSNorm one"),
])
def test_a_model_without_layernorms_is_refused(norm, message):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=4, vocab_size=11), norm)
    with pytest.raises(ConvertError, match=f"^{message}"):
        converted(model, "run7")


# -- the command, on the session's runs


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root`, by its path, with the sha256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


def probe_batch() -> torch.Tensor:
    return torch.from_numpy(np.fromfile(EMBEDDED / "val.bin", dtype=np.uint16)[: 2 * 128].astype(np.int64)).view(2, 128)


@pytest.fixture(scope="module")
def converted_run(sweep, tmp_path_factory) -> Path:
    """The session's LayerNorm run (seed 0), converted by the real normlab-convert into a new run directory; the
    source's files checked unchanged."""
    source = run_of(sweep, "layernorm")
    before = snapshot(source)
    out = tmp_path_factory.mktemp("converted") / "ln-rms"
    result = run_cli("normlab-convert", f"model_path={source}", f"out={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == (f"wrote {out} (rmsnorm_bias, {CHECKPOINT}): it computes what "
                             f"{(source / CHECKPOINT).resolve()} (layernorm, step 6) computes\n")
    assert snapshot(source) == before
    return out


def test_the_converted_run_directory_holds_one_checkpoint_of_the_same_function(sweep, converted_run):
    assert snapshot(converted_run).keys() == {"config.yaml", CHECKPOINT, f"{CHECKPOINT}.json"}
    digest = json.loads((converted_run / f"{CHECKPOINT}.json").read_text())
    assert (digest["step"], digest["contents"]) == (6, "weights")
    source = run_of(sweep, "layernorm")
    config = saved_config(read_checkpoint(converted_run / CHECKPOINT))
    original = saved_config(read_checkpoint(source / CHECKPOINT))
    composed = OmegaConf.to_container(compose_config("train", ["norm=rmsnorm_bias"]).norm, resolve=True)
    assert config["norm"] == composed and composed["layer"]["_target_"] == "normlab.model.norms.RMSNorm"
    assert config["model"] == {**original["model"], "tie_embeddings": False}
    assert (config["run_name"], config["run_dir"]) == ("ln-rms", str(converted_run))
    assert config["converted_from"] == {"command": "normlab-convert", "path": str((source / CHECKPOINT).resolve()),
                                        "step": 6, "norm": "layernorm"}
    assert {k: v for k, v in config.items() if k not in ("model", "norm", "run_name", "run_dir", "converted_from")} \
        == {k: v for k, v in original.items() if k not in ("model", "norm", "run_name", "run_dir")}
    assert yaml.safe_load((converted_run / "config.yaml").read_text()) == config
    model, expected = load_model(converted_run / CHECKPOINT).eval(), load_model(source / CHECKPOINT).eval()
    assert isinstance(model.ln_f, RMSNorm) and model.ln_f.bias is not None
    batch = probe_batch()
    torch.testing.assert_close(logits_of(model, batch), logits_of(expected, batch), rtol=0, atol=1e-4)


def test_normlab_angles_finds_the_converted_norm_inputs_at_90_degrees_to_1(sweep, converted_run, tmp_path):
    result = run_cli("normlab-angles", f"model_path={converted_run}", f"out={tmp_path / 'angles.csv'}",
                     "probe.tokens=2048", "probe.null_directions=0", "device=cpu")
    assert result.returncode == 0, result.stderr[-3000:]

    def input_rows(rows):
        return {(r["layer"], r["site"]): r for r in rows if r["site"].endswith(".input") and r["step"] == 6
                and r["reference"] == "uniform" and r["position"] == "all"}

    converted_rows = input_rows(read_csv(tmp_path / "angles.csv"))
    trained_rows = input_rows(read_csv(run_of(sweep, "layernorm") / "angles.csv"))  # measured while it trained
    assert converted_rows.keys() == trained_rows.keys() and len(converted_rows) == 5
    for key, row in converted_rows.items():
        assert (row["run"], row["norm"]) == ("ln-rms", "rmsnorm_bias")
        assert row["mean_cos2"] < 1e-10 < 1e-4 < trained_rows[key]["mean_cos2"], key
        assert abs(row["mean_deg"] - 90) < 1e-3, key

    # normlab-report takes the converted run through its angles CSV (it has no training metrics to compare)
    refused = run_cli("normlab-report", f"runs={converted_run}", f"out={tmp_path / 'report'}")
    assert refused.returncode == 2 and not (tmp_path / "report").exists()
    assert refused.stderr == (f"normlab-report: error: no run (metrics.csv + config.yaml) under {converted_run}: "
                              f"{converted_run} has no training metrics (a run of normlab-convert, say); give the CSV "
                              f"of `normlab-angles model_path={converted_run}` as csvs=[...]\n")
    reported = run_cli("normlab-report", f"csvs=[{tmp_path / 'angles.csv'}]", f"out={tmp_path / 'report'}")
    assert reported.returncode == 0, reported.stderr[-3000:]
    summary = (tmp_path / "report" / "summary.md").read_text().splitlines()
    (row,) = [line for line in summary if line.startswith("| ln-rms ")]
    (words,) = [line for line in summary if line.startswith("- ln-rms ")]
    assert "| rmsnorm_bias | 1 | 6 |" in row and "90.00°)" in words, (row, words)


def test_normlab_ablate_finds_that_centring_the_converted_model_changes_nothing(converted_run):
    result = run_cli("normlab-ablate", f"model_path={converted_run}", "probe.tokens=2048", "bootstrap=100",
                     "device=cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    found = read_rows(converted_run / "ablation.csv", lambda column, value: value)
    rows = [r for r in found if r["direction"] == "1"]  # the rest: the null, along 20 random directions
    assert [r["site"] for r in rows] == ["layer00.attn_norm", "layer00.mlp_norm", "layer01.attn_norm",
                                         "layer01.mlp_norm", "layer02.final_norm", "all"]
    assert len(found) == len(rows) + 20
    for row in rows:
        assert row["ablation"] == "centred" and row["norm"] == "rmsnorm_bias", row
        assert abs(float(row["delta"])) < 1e-6 and float(row["share_along_1"]) < 1e-10, row


def test_normlab_export_and_sample_read_the_converted_run(converted_run):
    exported = run_cli("normlab-export", f"model_path={converted_run}")
    assert exported.returncode == 0, exported.stderr[-3000:]
    config = json.loads((converted_run / "hf" / "step-0000006" / "config.json").read_text())
    assert config["model_type"] == "normlab_gpt2" and config["normlab"]["norm"] == "rmsnorm_bias"
    sampled = run_cli("normlab-sample", f"model_path={converted_run}", "max_new_tokens=4", "device=cpu")
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert sampled.stdout.startswith("----- sample 0 (seed 0) -----\n<|endoftext|>")


def test_normlab_eval_scores_the_converted_run_as_the_source(sweep, converted_run, tmp_path):
    """The held-out perplexity of the converted run equals the source's (a copy: the session's run stays as it is),
    on the first 8,192 held-out tokens (64 windows)."""
    source = Path(shutil.copytree(run_of(sweep, "layernorm"), tmp_path / "source"))
    losses = []
    for run in (source, converted_run):
        result = run_cli("normlab-eval", f"model_path={run}", "tasks=[perplexity_embedded]", "perplexity.tokens=8192",
                         "device=cpu")
        assert result.returncode == 0, result.stderr[-3000:]
        with open(run / "eval" / "results.csv") as f:
            (loss,) = [float(r["value"]) for r in csv.DictReader(f) if r["metric"] == "loss"]
        losses.append(loss)
    assert losses[1] == pytest.approx(losses[0], abs=1e-5)


def test_the_default_out_lies_beside_the_run_and_is_never_written_over(sweep, tmp_path):
    run = Path(shutil.copytree(run_of(sweep, "layernorm"), tmp_path / "runs" / "ln"))
    first = run_cli("normlab-convert", f"model_path={run}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.startswith(f"wrote {tmp_path / 'runs' / 'ln-rms'} (rmsnorm_bias, ")
    before = snapshot(tmp_path)
    again = run_cli("normlab-convert", f"model_path={run}")
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr == (f"normlab-convert: error: out={tmp_path / 'runs' / 'ln-rms'} exists: normlab-convert "
                            "writes a new run directory and never writes over anything; give a new path\n")
    assert snapshot(tmp_path) == before
    of_checkpoint = run_cli("normlab-convert", f"model_path={run / 'checkpoints' / 'step-0000004.ckpt'}")
    assert of_checkpoint.returncode == 0, of_checkpoint.stderr[-3000:]
    assert (tmp_path / "runs" / "ln-rms-step-0000004" / "checkpoints" / "step-0000004.ckpt.json").is_file()


@pytest.mark.parametrize("case", ["rmsnorm run", "missing path", "existing out", "out inside a run"])
def test_what_cannot_be_converted_is_one_line_and_writes_nothing(sweep, tmp_path, case):
    layernorm, rmsnorm = run_of(sweep, "layernorm"), run_of(sweep, "rmsnorm")
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "notes.txt").write_text("mine\n")
    model_path, out, message = {
        "rmsnorm run": (rmsnorm, tmp_path / "new", f"{(rmsnorm / CHECKPOINT).resolve()} (norm=rmsnorm) is already an "
                        "RMSNorm model: nothing to convert (a LayerNorm model converts into an RMSNorm one)"),
        "missing path": (tmp_path / "nothing", tmp_path / "new", f"{tmp_path / 'nothing'} does not exist: give a "
                         "LayerNorm .ckpt, a run directory or a Hugging Face GPT-2 model directory"),
        "existing out": (layernorm, tmp_path / "existing", f"out={tmp_path / 'existing'} exists: normlab-convert "
                         "writes a new run directory and never writes over anything; give a new path"),
        "out inside a run": (layernorm, layernorm / "rms", f"out={layernorm / 'rms'} lies inside a run directory, "
                             f"{layernorm}, which normlab-convert must not write to: give a path outside it"),
    }[case]
    before = {root: snapshot(root) for root in (tmp_path, layernorm, rmsnorm)}
    result = run_cli("normlab-convert", f"model_path={model_path}", f"out={out}")
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"normlab-convert: error: {message}\n")
    assert {root: snapshot(root) for root in before} == before
    assert not (tmp_path / "new").exists() and not any(p.name.startswith(".new") for p in tmp_path.iterdir())


# -- a Hugging Face GPT-2 directory


def random_gpt2(path: Path, tied: bool):
    """A tiny random transformers GPT-2, its embeddings given a non-zero mean and every bias and gain made random,
    saved in `path`; the model, in eval mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(4)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=32, vocab_size=97, bos_token_id=0,
                        eos_token_id=0, tie_word_embeddings=tied)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
        model.transformer.wte.weight.add_(0.5)
        model.transformer.wpe.weight.add_(-0.3)
        if not tied:
            model.lm_head.weight.copy_(torch.randn_like(model.lm_head.weight) * 0.05)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_hugging_face_gpt2_converts_to_the_same_logits(tmp_path, tied):
    hf_model = random_gpt2(tmp_path / "gpt2", tied)
    main(compose_config("convert", [f"model_path={tmp_path / 'gpt2'}"]))
    checkpoint = tmp_path / "gpt2-rms" / "checkpoints" / "step-0000000.ckpt"
    config = saved_config(read_checkpoint(checkpoint))
    assert (config["run_name"], config["model"]["name"], config["norm"]["name"]) == ("gpt2-rms", "gpt2",
                                                                                     "rmsnorm_bias")
    assert config["converted_from"] == {"command": "normlab-convert", "path": str((tmp_path / "gpt2").resolve()),
                                        "step": 0, "norm": "LayerNorm"}  # its norm's class: normlab did not export it
    model = load_model(checkpoint).eval()
    assert isinstance(model.ln_f, RMSNorm) and not model.config.tie_embeddings and model.config.block_size == 32
    ids = torch.randint(0, 97, (3, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf_model(ids).logits
    assert expected.abs().max() > 1
    torch.testing.assert_close(logits_of(model, ids), expected, rtol=0, atol=1e-4)


def test_a_hugging_face_model_that_is_no_gpt2_of_normlabs_blocks_is_refused(tmp_path):
    from transformers import GPT2Config

    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    GPT2Config(n_layer=1, n_head=2, n_embd=8, n_positions=4, vocab_size=11, activation_function="relu",
               n_inner=16).save_pretrained(tmp_path / "relu")
    for name, message in [
        ("llama", "model type llama: normlab-convert converts Hugging Face GPT-2 models (model type gpt2) only"),
        ("relu", "is a GPT-2 that normlab's GPT does not compute: activation_function=relu (normlab: the tanh GELU, "
                 "gelu_new), n_inner=16 (normlab: 4 n_embd)"),
    ]:
        with pytest.raises(ConvertError) as error:
            main(compose_config("convert", [f"model_path={tmp_path / name}"]))
        assert str(error.value).startswith(str(tmp_path / name)) and str(error.value).endswith(message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "relu"]


def test_a_source_still_being_trained_is_named_as_a_snapshot(sweep, tmp_path, capsys):
    """The run's claim names a live process (this one): the conversion says that its step is a snapshot of a run in
    progress; once the claim is released, nothing is said."""
    run = Path(shutil.copytree(run_of(sweep, "layernorm"), tmp_path / "run"))
    (run / CLAIM_FILE).write_text(json.dumps(this_process()))
    main(compose_config("convert", [f"model_path={run}", f"out={tmp_path / 'snapshot'}"]))
    assert (f"warning: {run} is still being trained (pid {os.getpid()} on {socket.gethostname()}, since "
            in capsys.readouterr().err)
    (run / CLAIM_FILE).write_text(json.dumps({**this_process(), "released": True}))
    main(compose_config("convert", [f"model_path={run}", f"out={tmp_path / 'finished'}"]))
    assert "still being trained" not in capsys.readouterr().err
