"""normlab-export and normlab.export.hugging_face: GPT-2's tokenizer rebuilt from the tiktoken ranks gives tiktoken's
ids; a trained LayerNorm and RMSNorm run, exported, give normlab's logits with transformers."""

import numpy as np
import pytest
import torch
from conftest import DOCS, EMBEDDED, FAST_TRAIN, run_cli
from normlab import tokenizer as gpt2
from normlab.angles import load_normlab
from normlab.export import gpt2_tokenizer, hugging_face

NORMS = ("layernorm_nobias", "rmsnorm_bias")  # the bias-free LN gets zero biases; the RMS model keeps its bias


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory) -> dict:
    """One tiny run per norm, trained by the real normlab-train (untied LM head, the preset's default)."""
    root = tmp_path_factory.mktemp("runs")
    for norm in NORMS:
        result = run_cli("normlab-train", f"norm={norm}", f"run_dir={root / norm}", *FAST_TRAIN)
        assert result.returncode == 0, result.stderr[-3000:]
    return {norm: root / norm for norm in NORMS}


def embedded_documents(split: str) -> list[np.ndarray]:
    """The token ids of each document of a prepared split (each followed by EOT in the file)."""
    ids = np.fromfile(EMBEDDED / f"{split}.bin", dtype=np.uint16).astype(np.int64)
    return np.split(ids, np.flatnonzero(ids == gpt2.EOT) + 1)[:-1]


def test_the_tokenizer_gives_tiktokens_ids_on_the_embedded_corpus(prepared):
    tokenizer, encoding = gpt2_tokenizer(), gpt2.gpt2()
    assert type(tokenizer).__name__ == "GPT2Tokenizer" and len(tokenizer) == gpt2.VOCAB_SIZE
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == tokenizer.unk_token_id == gpt2.EOT
    documents = embedded_documents("train") + embedded_documents("val")
    assert len(documents) == 42
    texts = [encoding.decode(doc[:-1].tolist()) for doc in documents]
    for doc, ids in zip(documents, tokenizer(texts)["input_ids"]):
        assert ids == doc[:-1].tolist()
    for text in DOCS:  # accents, a symbol, an emoji: byte-level merges beyond ASCII
        assert tokenizer(text)["input_ids"] == encoding.encode(text)
        assert tokenizer.decode(encoding.encode(text)) == text


@pytest.mark.parametrize("norm", NORMS)
def test_hugging_face_gives_normlabs_logits(runs, norm):
    checkpoint = runs[norm] / "checkpoints" / "step-0000006.ckpt"
    model, tokenizer = hugging_face(checkpoint)
    expected_class = "GPT2LMHeadModel" if norm.startswith("layernorm") else "NormlabRMSGPT2LMHeadModel"
    assert type(model).__name__ == expected_class and not model.training
    assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()  # untied, as trained
    assert model.config.normlab == {"run": model.config.normlab["run"], "model": "tiny", "norm": norm, "seed": 0,
                                    "step": 6, "checkpoint": "step-0000006.ckpt"}
    assert tokenizer.model_max_length == model.config.n_positions == 128
    batch = torch.from_numpy(embedded_documents("val")[0][: 4 * 128].reshape(4, 128))
    with torch.no_grad():
        logits, expected = model(batch).logits, load_normlab(checkpoint).eval()(batch)
    assert logits.shape == expected.shape == (4, 128, gpt2.VOCAB_SIZE)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)
    half, _ = hugging_face(checkpoint, dtype="bfloat16")
    assert half.dtype == torch.bfloat16
