"""normlab-export and interop.export.hugging_face, on a LayerNorm run (without bias), an RMSNorm run (with bias) and a
DyT run, each trained once by the real normlab-train: the exported directories give normlab's logits with
transformers, the angle statistics of the checkpoint (real normlab-angles), GPT-2's ids with their tokenizer
(tiktoken's, on the whole embedded corpus), the RMSNorm and DyT ones load with trust_remote_code in a process that
never imports normlab, and normlab-ablate centres the DyT export's norms; and random models of every norm, with and
without bias, with a tied head."""

import csv
import json
import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2TokenizerFast

from conftest import DOCS, EMBEDDED, FAST_TRAIN, compose_config, run_cli
from normlab.data import tokenizer as gpt2
from normlab.interop.export import ExportError, hf_model, hugging_face, main
from normlab.model.gpt import GPT, GPTConfig
from normlab.model.norms import DyT, LayerNorm, RMSNorm
from normlab.probe.table import read_csv
from normlab.training.loader import load_model

NORMS = ("layernorm_nobias", "rmsnorm_bias", "dyt")  # the bias-free LN gets zero biases; the RMS model keeps its bias
# the model type and class of each norm's export
EXPORTED_AS = {"layernorm_nobias": ("gpt2", "GPT2LMHeadModel"),
               "rmsnorm_bias": ("normlab_rms_gpt2", "NormlabRMSGPT2LMHeadModel"),
               "dyt": ("normlab_dyt_gpt2", "NormlabDyTGPT2LMHeadModel")}
CHECKPOINT = "checkpoints/step-0000006.ckpt"  # the newest of FAST_TRAIN's runs


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory) -> Path:
    """<root>/<norm>: one tiny run per norm, trained by one real normlab-train sweep (its LM head untied, as the
    preset's); the RMSNorm run exported by the real normlab-export (to its default out), the others in-process."""
    root = tmp_path_factory.mktemp("runs")
    result = run_cli("normlab-train", "-m", f"norm={','.join(NORMS)}", f"run_dir={root}/${{norm.name}}", *FAST_TRAIN)
    assert result.returncode == 0, result.stderr[-3000:]
    exported = run_cli("normlab-export", f"model_path={root / 'rmsnorm_bias'}")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert exported.stdout.startswith(f"wrote {root / 'rmsnorm_bias/hf/step-0000006'} (NormlabRMSGPT2LMHeadModel")
    for norm in ("layernorm_nobias", "dyt"):
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
    exported = export_of(runs, "layernorm_nobias")
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
    # what normlab-angles does: from_pretrained then needs no remote code
    import normlab.interop.hf_dyt_gpt2  # noqa: F401
    import normlab.interop.hf_rmsnorm_gpt2  # noqa: F401

    exported = export_of(runs, norm)
    config = json.loads((exported / "config.json").read_text())
    expected_type, expected_class = EXPORTED_AS[norm]
    assert config["model_type"] == expected_type and config["tie_word_embeddings"] is False
    assert config["normlab"] == {"run": config["normlab"]["run"], "model": "tiny", "norm": norm, "seed": 0, "step": 6,
                                 "checkpoint": "step-0000006.ckpt"}
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(model).__name__ == expected_class
    assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()  # untied, as trained
    trained = load_model(runs / norm / CHECKPOINT).eval()
    if norm == "layernorm_nobias":
        assert all(not m.bias.any() for name, m in model.named_modules() if name.endswith(("ln_1", "ln_2", "ln_f")))
    else:
        assert config["norm_bias"] is True and model.transformer.ln_f.bias.abs().sum() > 0  # trained: not zeros
    if norm == "dyt":  # alpha_init is the config's; the trained alphas are the weights'
        assert config["alpha_init"] == 0.5 and type(model.transformer.ln_f).__name__ == "DyT"
        assert torch.equal(model.transformer.h[1].ln_2.alpha, trained.blocks[1].ln_2.alpha)
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
    finds, verifies and builds it (common.paths.current_targets), into the same model."""
    from normlab.training.checkpoint_files import write_checkpoint
    from normlab.training.loader import chosen, read_checkpoint, saved_config

    trained = runs / "rmsnorm_bias" / CHECKPOINT
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


@pytest.mark.parametrize("norm, code, norm_class", [("rmsnorm_bias", "hf_rmsnorm_gpt2", "RMSNorm"),
                                                    ("dyt", "hf_dyt_gpt2", "DyT")])
def test_the_export_of_another_norm_loads_with_trust_remote_code_without_normlab(runs, tmp_path, norm, code,
                                                                                 norm_class):
    copy = shutil.copytree(export_of(runs, norm), tmp_path / "copy")
    batch = probe_batch()
    torch.save(batch, tmp_path / "batch.pt")
    script = (
        "import sys, torch; from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained('copy', trust_remote_code=True).eval()\n"
        "with torch.no_grad(): torch.save(model(torch.load('batch.pt')).logits, 'logits.pt')\n"
        "print(type(model).__module__, type(model.transformer.ln_f).__name__, 'normlab' in sys.modules)\n"
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
    assert (Path(copy) / f"{code}.py").read_text().count("import normlab") == 0
    assert {p.name for p in Path(copy).glob("hf_*.py")} == {f"{code}.py"}  # its own norm's code only


def test_normlab_ablate_centres_the_norms_of_the_dyt_export(runs, tmp_path, capsys):
    from normlab.study import ablate

    exported = export_of(runs, "dyt")
    ablate.main(compose_config("ablate", [f"model_path={exported}", "probe.tokens=256", "seq_len=32", "bootstrap=50",
                                          f"paths.output_dir={tmp_path}"]))
    assert "wrote " in capsys.readouterr().out
    (out,) = (tmp_path / "ablation").rglob("*.csv")
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5 + 1  # 2 blocks x 2 norms, the final norm, and all of them at once
    assert {(r["model"], r["norm"], r["step"], r["ablation"]) for r in rows} == {
        ("normlab_dyt_gpt2", "dyt", "6", "centred")}


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


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("norm", [LayerNorm, RMSNorm, DyT])
def test_every_norm_with_a_tied_head_exports_to_the_same_logits(tmp_path, norm, bias):
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, tie_embeddings=True), partial(norm, bias=bias))
    model.init_weights(seed=1)
    with torch.no_grad():  # gains, biases and DyT's alphas away from 1, 0 and alpha_init, so that a wrong mapping shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    hf_model(model.eval(), {"run": "random"}).save_pretrained(tmp_path)
    import normlab.interop.hf_dyt_gpt2  # noqa: F401 (registers the DyT model type)
    import normlab.interop.hf_rmsnorm_gpt2  # noqa: F401 (registers the RMSNorm model type)

    exported = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert exported.config.tie_word_embeddings and exported.lm_head.weight is exported.transformer.wte.weight
    model_types = {LayerNorm: "gpt2", RMSNorm: "normlab_rms_gpt2", DyT: "normlab_dyt_gpt2"}
    assert exported.config.model_type == model_types[norm]
    ids = torch.randint(0, gpt2.VOCAB_SIZE, (3, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, model(ids), rtol=1e-5, atol=1e-5)
