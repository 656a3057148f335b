"""normlab-export and interop.export.hugging_face, on a run of every norm of conf/norm/*.yaml (LayerNorm and RMSNorm
with and without bias, DyT), all trained by one real normlab-train sweep: the exported directories give normlab's
logits with transformers, the angle statistics of the checkpoint (real normlab-angles), GPT-2's ids with their
tokenizer (tiktoken's, on the whole embedded corpus); those of every norm but LayerNorm (GPT-2 with the norm's own
module as their code) load with trust_remote_code in a process where normlab cannot be imported; normlab-ablate
ablates each export as its checkpoint, and normlab-report compares the runs; and random models of every norm, with a
tied head."""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2TokenizerFast

from conftest import DOCS, EMBEDDED, FAST_TRAIN, NORM_CONFIGS, compose_config, norm_layer, run_cli
from normlab.data import tokenizer as gpt2
from normlab.interop.export import ExportError, hf_model, hugging_face, main
from normlab.model import norms
from normlab.model.gpt import GPT, GPTConfig
from normlab.probe.table import read_csv
from normlab.training.loader import load_model
from normlab.training.pipeline import build_model

NORMS = NORM_CONFIGS
CHECKPOINT = "checkpoints/step-0000006.ckpt"  # the newest of FAST_TRAIN's runs
CLI_EXPORTED = "rmsnorm_bias"  # the run exported by the real normlab-export; the others in-process


def exported_as(norm: str) -> tuple[str, str]:
    """The model type and class of a norm's export: transformers' GPT-2 for its LayerNorm, normlab's for any other."""
    if norms.is_layernorm(norm_layer(norm)):
        return "gpt2", "GPT2LMHeadModel"
    return "normlab_gpt2", "NormlabGPT2LMHeadModel"


OTHER_NORMS = [n for n in NORMS if exported_as(n)[0] == "normlab_gpt2"]


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory) -> Path:
    """<root>/<norm>: one tiny run per norm, trained by one real normlab-train sweep (its LM head untied, as the
    preset's); one run exported by the real normlab-export (to its default out), the others in-process."""
    root = tmp_path_factory.mktemp("runs")
    result = run_cli("normlab-train", "-m", f"norm={','.join(NORMS)}", f"run_dir={root}/${{norm.name}}", *FAST_TRAIN)
    assert result.returncode == 0, result.stderr[-3000:]
    exported = run_cli("normlab-export", f"model_path={root / CLI_EXPORTED}")
    assert exported.returncode == 0, exported.stderr[-3000:]
    written = root / CLI_EXPORTED / "hf" / "step-0000006"
    assert exported.stdout.startswith(f"wrote {written} ({exported_as(CLI_EXPORTED)[1]}")
    for norm in NORMS:
        if norm != CLI_EXPORTED:
            main(compose_config("export", [f"model_path={root / norm / CHECKPOINT}"]))
    return root


def export_of(runs: Path, norm: str) -> Path:
    return runs / norm / "hf" / "step-0000006"


def embedded_documents(split: str) -> list[np.ndarray]:
    """The token ids of each document of a prepared split (each followed by EOT in the file)."""
    ids = np.fromfile(EMBEDDED / f"{split}.bin", dtype=np.uint16).astype(np.int64)
    return np.split(ids, np.flatnonzero(ids == gpt2.EOT) + 1)[:-1]


def probe_batch() -> torch.Tensor:
    return torch.from_numpy(embedded_documents("val")[0][: 4 * 128].reshape(4, 128))


def test_the_exported_tokenizer_gives_tiktokens_ids_on_the_embedded_corpus(runs, tmp_path):
    exported = export_of(runs, NORMS[0])
    assert {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"} <= {p.name for p in
                                                                                        exported.iterdir()}
    tokenizer, encoding = AutoTokenizer.from_pretrained(exported), gpt2.gpt2()
    assert isinstance(tokenizer, GPT2TokenizerFast) and len(tokenizer) == gpt2.VOCAB_SIZE
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == tokenizer.unk_token_id == gpt2.EOT
    documents = embedded_documents("train") + embedded_documents("val")
    assert len(documents) == 42
    texts = [encoding.decode(doc[:-1].tolist()) for doc in documents]
    for doc, ids in zip(documents, tokenizer(texts)["input_ids"]):
        assert ids == doc[:-1].tolist()
    for text in DOCS:  # accents, a symbol, an emoji: byte-level merges beyond ASCII
        assert tokenizer(text)["input_ids"] == encoding.encode(text)
        assert tokenizer.decode(encoding.encode(text)) == text
    for name in ("vocab.json", "merges.txt"):  # GPT-2's files, for tools that build the tokenizer from them alone
        shutil.copy(exported / name, tmp_path / name)
    from_files = GPT2TokenizerFast.from_pretrained(tmp_path)
    assert len(json.loads((tmp_path / "vocab.json").read_text())) == gpt2.VOCAB_SIZE
    assert len((tmp_path / "merges.txt").read_text().splitlines()) == 1 + gpt2.EOT - 256  # a header, then merges
    assert from_files(texts[-1])["input_ids"] == documents[-1][:-1].tolist()
    assert [from_files(text)["input_ids"] for text in DOCS] == [encoding.encode(text) for text in DOCS]


@pytest.mark.parametrize("norm", NORMS)
def test_the_export_gives_normlabs_logits(runs, norm):
    exported = export_of(runs, norm)
    config = json.loads((exported / "config.json").read_text())
    expected_type, expected_class = exported_as(norm)
    assert config["model_type"] == expected_type and config["tie_word_embeddings"] is False
    assert config["normlab"] == {"run": config["normlab"]["run"], "model": "tiny", "norm": norm, "seed": 0, "step": 6,
                                 "checkpoint": "step-0000006.ckpt"}
    model = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=expected_type == "normlab_gpt2").eval()
    assert type(model).__name__ == expected_class
    assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()  # untied, as trained
    trained = load_model(runs / norm / CHECKPOINT).eval()
    if expected_type == "gpt2":  # a LayerNorm without bias: GPT-2's, with zero biases
        assert trained.ln_f.bias is not None or not model.transformer.ln_f.bias.any()
    else:  # the norm's class, its arguments as trained, every parameter of it the checkpoint's
        layer = compose_config("train", [f"norm={norm}"]).norm.layer
        assert config["norm_class"] == type(trained.ln_f).__name__ == type(model.transformer.ln_f).__name__
        assert config["norm_args"] == {k: v for k, v in layer.items() if not k.startswith("_")}
        for name, value in trained.blocks[1].ln_2.state_dict().items():
            assert torch.equal(model.transformer.h[1].ln_2.state_dict()[name], value), name
    batch = probe_batch()
    with torch.no_grad():
        logits, expected = model(batch).logits, trained(batch)
    assert logits.shape == expected.shape == (4, 128, gpt2.VOCAB_SIZE)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("norm", NORMS)
def test_hugging_face_gives_normlabs_logits_in_memory(runs, norm):
    model, tokenizer = hugging_face(runs / norm / CHECKPOINT)
    assert not model.training and isinstance(tokenizer, GPT2TokenizerFast)
    assert tokenizer.model_max_length == model.config.n_positions == 128
    assert model.config.normlab["norm"] == norm and model.config.normlab["step"] == 6
    batch = probe_batch()
    with torch.no_grad():
        expected = load_model(runs / norm / CHECKPOINT).eval()(batch)
        torch.testing.assert_close(model(batch).logits, expected, rtol=1e-5, atol=1e-4)
        half, _ = hugging_face(runs / norm / CHECKPOINT, dtype="bfloat16")
        assert half.dtype == torch.bfloat16 and (half(batch).logits.float() - expected).abs().mean() < 0.05


def test_a_checkpoint_written_before_the_subpackages_loads_with_the_same_logits(runs, tmp_path):
    """A checkpoint saved before normlab had subpackages names its norm normlab.norms.RMSNorm: the loader still
    finds, verifies and builds it (common.moved.current_config), into the same model."""
    from normlab.training.loader import chosen, read_checkpoint, saved_config
    from normlab.training.rundir.checkpoints import write_checkpoint

    trained = runs / CLI_EXPORTED / CHECKPOINT
    checkpoint = torch.load(trained, map_location="cpu", weights_only=False)
    layer = checkpoint["hyper_parameters"]["config"]["norm"]["layer"]
    assert layer["_target_"] == "normlab.model.norms.RMSNorm"
    layer["_target_"] = "normlab.norms.RMSNorm"  # as written before the move
    old = tmp_path / "old.ckpt"
    write_checkpoint(checkpoint, old)
    assert read_checkpoint(old)["hyper_parameters"]["config"]["norm"]["layer"]["_target_"] == "normlab.norms.RMSNorm"
    assert saved_config(read_checkpoint(old))["norm"]["layer"]["_target_"] == "normlab.model.norms.RMSNorm"
    assert chosen(old, ExportError)[:2] == (old, 6)
    batch = probe_batch()
    with torch.no_grad():
        torch.testing.assert_close(load_model(old).eval()(batch), load_model(trained).eval()(batch), rtol=0, atol=0)


def test_normlab_angles_gives_the_same_rows_for_the_export_and_the_checkpoint(runs, tmp_path):
    paths = [p for norm in NORMS for p in (runs / norm / CHECKPOINT, export_of(runs, norm))]
    result = run_cli("normlab-angles", "-m", f"model_path={','.join(map(str, paths))}", f"paths.output_dir={tmp_path}",
                     "probe.tokens=8192", "probe.null_directions=8", "device=cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [row for csv_file in sorted((tmp_path / "angles").rglob("*.csv")) for row in read_csv(csv_file)]
    by_source = {}
    for row in rows:
        by_source.setdefault(row["source"], {})[(row["layer"], row["site"], row["reference"], row["position"])] = row
    for norm in NORMS:
        checkpoint = by_source[str((runs / norm / CHECKPOINT).resolve())]
        exported = by_source[str(export_of(runs, norm).resolve())]
        assert checkpoint.keys() == exported.keys() and len(checkpoint) >= 5 * 7 * 2  # 5 norms, 7 rows, 2+ positions
        for key, row in checkpoint.items():
            other = exported[key]
            assert other["count"] == row["count"] > 0, key
            assert abs(other["mean_deg"] - row["mean_deg"]) < 1e-4 and abs(other["std_deg"] - row["std_deg"]) < 1e-4
            assert (other["run"], other["norm"], other["seed"], other["step"]) == (
                row["run"], row["norm"], str(row["seed"]), row["step"]), key


@pytest.mark.parametrize("norm", OTHER_NORMS)
def test_the_export_of_another_norm_loads_with_trust_remote_code_without_normlab(runs, tmp_path, norm):
    code, norm_class = "modeling_normlab_gpt2", type(norm_layer(norm)).__name__
    copy = shutil.copytree(export_of(runs, norm), tmp_path / "copy")
    batch = probe_batch()
    torch.save(batch, tmp_path / "batch.pt")
    script = (  # normlab made unimportable: as on a machine without it
        "import sys, torch; sys.modules['normlab'] = None; from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained('copy', trust_remote_code=True).eval()\n"
        "with torch.no_grad(): torch.save(model(torch.load('batch.pt')).logits, 'logits.pt')\n"
        "print(type(model).__module__, type(model.transformer.ln_f).__name__, sys.modules['normlab'] is not None)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {"HF_HOME": str(tmp_path / "hf_home")}
    result = subprocess.run([sys.executable, "-I", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    module, loaded_norm_class, normlab_imported = result.stdout.split()
    assert module.startswith("transformers_modules") and module.endswith(code)
    assert (loaded_norm_class, normlab_imported) == (norm_class, "False")
    expected = load_model(runs / norm / CHECKPOINT).eval()(batch).detach()
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=1e-5, atol=1e-4)
    assert {p.name for p in Path(copy).glob("*.py")} == {f"{code}.py"}  # the norm's module and GPT-2 around it


@pytest.mark.parametrize("norm", NORMS)
def test_normlab_ablate_ablates_each_export_as_its_checkpoint(runs, tmp_path, norm):
    """A centring norm's export is uncentred, any other's centred at its input, with the checkpoint's deltas."""
    from normlab.study import ablate

    settings = ["probe.tokens=256", "seq_len=32", "bootstrap=50"]
    for i, path in enumerate((export_of(runs, norm), runs / norm / CHECKPOINT)):
        ablate.main(compose_config("ablate", [f"model_path={path}", *settings, f"out={tmp_path / f'{i}.csv'}"]))
    exported, trained = (list(csv.DictReader(open(tmp_path / f"{i}.csv", newline=""))) for i in range(2))
    assert len(exported) == 5 + 1 + 20  # 2 blocks x 2 norms, the final norm, all at once, and the null's 20
    kind = "uncentred" if norms.traits(norm_layer(norm)).centres else "centred"
    assert {(r["model"], r["norm"], r["step"], r["ablation"]) for r in exported} == {
        (exported_as(norm)[0], norm, "6", kind)}
    for a, b in zip(exported, trained):  # the null's directions too: the same for both (one seed, one width)
        assert (a["site"], a["direction"]) == (b["site"], b["direction"]), (a, b)
        assert abs(float(a["delta"]) - float(b["delta"])) < 1e-4, (a, b)


def test_normlab_report_compares_the_runs_of_every_norm(runs, tmp_path):
    """The 2x2 of the norms that are LayerNorm with or without its centring, with and without bias, and every other
    norm against layernorm, the reference: each comparison of one seed, labelled by the norms' names."""
    from normlab.study import report
    from normlab.study.report.groups import Declared

    report.report([runs], tmp_path / "report", declared=Declared(learning_check="off"))  # runs of a few steps
    summary = (tmp_path / "report" / "summary.md").read_text()
    pairing = [n for n in NORMS if norms.traits(norm_layer(n)).centring_pair]
    for norm in NORMS:
        assert f"| {norm} |" in summary, norm
    for other in (n for n in NORMS if n not in pairing):
        assert f"{other} − layernorm" in summary, other


@pytest.mark.parametrize(
    "model_path, message",
    [
        ("nothing", "{tmp}/nothing does not exist: give a .ckpt or a run directory"),
        ("empty", "no checkpoint at {tmp}/empty (neither a .ckpt nor a run directory with checkpoints/*.ckpt)"),
        ("bad.ckpt", "{tmp}/bad.ckpt has no digest file bad.ckpt.json"),
    ],
)
def test_what_cannot_be_exported_is_one_error(tmp_path, model_path, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(ExportError) as error:
        main(compose_config("export", [f"model_path={tmp_path / model_path}"]))
    assert str(error.value).startswith(message.format(tmp=tmp_path)) and "\n" not in str(error.value)


@pytest.mark.parametrize("norm", NORMS)
def test_every_norm_with_a_tied_head_exports_to_the_same_logits(tmp_path, norm):
    factory = instantiate(compose_config("train", [f"norm={norm}"]).norm.layer)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, tie_embeddings=True), factory)
    model.init_weights(seed=1)
    with torch.no_grad():  # gains, biases and DyT's alphas away from 1, 0 and alpha_init, so that a wrong mapping shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    hf_model(model.eval(), {"run": "random"}).save_pretrained(tmp_path)
    model_type = exported_as(norm)[0]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=model_type == "normlab_gpt2").eval()
    assert exported.config.tie_word_embeddings and exported.lm_head.weight is exported.transformer.wte.weight
    assert exported.config.model_type == model_type
    ids = torch.randint(0, gpt2.VOCAB_SIZE, (3, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, model(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm, sites", [
    ("scalenorm", ["+norm.sites.final.eps=1000.0", "+norm.sites.attention.g_init=0.5"]),  # a user's: each site's own
    ("layernorm", ["+norm.sites.final.eps=1000.0"]),  # GPT-2's LayerNorm takes one eps: exported with its own class
    ("dyt", ["norm.sites.mlp.alpha_init=0.2", "norm.sites.final.alpha_init=0.9"]),
])
def test_every_setting_a_norm_was_built_with_is_exported_per_site(tmp_path, norm, sites):
    """A norm whose sites differ (norm.sites) exports each site kind's settings: the exported model's logits are
    normlab's, where an export of norm.layer's alone differed by more than 1."""
    (tmp_path / "conf" / "norm").mkdir(parents=True)  # tests/user_norms.py's ScaleNorm as a user's yaml names it
    (tmp_path / "conf" / "norm" / "scalenorm.yaml").write_text(
        "name: scalenorm\nlayer:\n  _target_: user_norms.ScaleNorm\n  _partial_: true\n  eps: 1.0e-5\n")
    user = [f"hydra.searchpath=[file://{tmp_path / 'conf'}]"]
    cfg = compose_config("train", ["model=tiny", "model.n_layer=2", f"norm={norm}", *sites, *user])
    model = build_model(cfg)
    model.init_weights(seed=3)
    out = tmp_path / "hf"
    hf_model(model.eval(), {"run": "sites"}, OmegaConf.to_container(cfg.norm, resolve=True)).save_pretrained(out)
    exported = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert exported.config.model_type == "normlab_gpt2" and exported.config.norm_site_args
    ids = torch.randint(0, gpt2.VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, model(ids), rtol=1e-5, atol=1e-4)
