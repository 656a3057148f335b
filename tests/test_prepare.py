"""Preparation of local corpora with the real datasets + tiktoken code, and the checks before training."""

import json
import time

import numpy as np
import pytest
import tiktoken
from hydra.utils import instantiate
from tiktoken_ext import openai_public

from conftest import DOCS, compose_config, local_corpus_config, run_cli
from train import tokenizer
from train.errors import DataError



def test_tokenizer_is_tiktokens_gpt2(prepared):
    ours = tokenizer.gpt2()
    # tiktoken's own GPT-2 split pattern and special token, with the ranks from our hash-checked file
    reference = tiktoken.Encoding(name="ref", pat_str=openai_public.r50k_pat_str, special_tokens={"<|endoftext|>": 50256},
                                  mergeable_ranks=ours._mergeable_ranks, explicit_n_vocab=50257)
    assert ours.encode_ordinary("Hello world") == [15496, 995]
    assert ours.encode_ordinary("Hello, my dog is cute") == [15496, 11, 616, 3290, 318, 13779]
    assert ours.encode("<|endoftext|>", allowed_special="all") == [50256]
    for text in DOCS[:10] + ["  leading spaces\n\nand\ttabs", "numbers 1234567 and 3.14159", "I'm you're we'll"]:
        assert ours.encode_ordinary(text) == reference.encode_ordinary(text)
        assert ours.decode(ours.encode_ordinary(text)) == text


def test_prepared_corpus_round_trips_to_its_documents(local_corpus):
    meta = json.loads((local_corpus / "meta.json").read_text())
    enc = tokenizer.gpt2()
    seen = []
    for split, expected_docs in (("train", 54), ("val", 6)):
        info = meta["splits"][split]
        tokens = np.fromfile(local_corpus / info["file"], dtype=np.uint16)
        assert tokens.size == info["tokens"] and info["documents"] == expected_docs
        assert info["max_token"] == tokens.max() and tokenizer.sha256_file(local_corpus / info["file"]) == info["sha256"]
        text = enc.decode(tokens.tolist())
        docs = text.split("<|endoftext|>")
        assert docs[-1] == "" and len(docs) - 1 == expected_docs  # an EOT after every document
        seen += docs[:-1]
        assert text == "".join(d + "<|endoftext|>" for d in docs[:-1])
    assert sorted(seen) == sorted(DOCS)
    assert meta["source"]["split_seed"] == 2357 and meta["tokenizer"]["ranks_sha256"] == tokenizer.RANKS_SHA256


def test_validation_split_is_deterministic(local_corpus, tmp_path):
    result = run_cli("normlab-prepare", *local_corpus_config(local_corpus), f"data.dir={tmp_path}", env={"HF_DATASETS_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    for split in ("train.bin", "val.bin"):
        assert (tmp_path / split).read_bytes() == (local_corpus / split).read_bytes()


def test_probe_set_is_the_first_tokens_of_the_documents_in_order(tmp_path, local_corpus):
    result = run_cli("normlab-prepare", *local_corpus_config(local_corpus), f"data.dir={tmp_path}",
                     "+data.source.probe_tokens=700", env={"HF_DATASETS_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    enc = tokenizer.gpt2()
    expected = [t for doc in DOCS for t in enc.encode_ordinary(doc) + [tokenizer.EOT]][:700]
    assert np.fromfile(tmp_path / "probe.bin", dtype=np.uint16).tolist() == expected
    assert json.loads((tmp_path / "meta.json").read_text())["splits"]["probe"]["tokens"] == 700


def test_probe_set_larger_than_the_source_is_refused(tmp_path, local_corpus):
    result = run_cli("normlab-prepare", *local_corpus_config(local_corpus), f"data.dir={tmp_path}",
                     "+data.source.probe_tokens=10000000", env={"HF_DATASETS_OFFLINE": "1"})
    assert result.returncode == 2 and "fewer than probe_tokens=10,000,000" in result.stderr
    assert not (tmp_path / "meta.json").exists()


def test_hub_dataset_offline_fails_at_once_with_the_way_out(tmp_path):
    started = time.perf_counter()
    result = run_cli("normlab-prepare", "data=openwebtext", f"data.dir={tmp_path / 'owt'}",
                     env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert time.perf_counter() - started < 30
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "Skylion007/openwebtext" in line and "HF_HUB_OFFLINE" in line and "normlab-prepare data=openwebtext" in line
    assert not (tmp_path / "owt").exists()


def test_missing_local_file_is_named(tmp_path):
    result = run_cli("normlab-prepare", "data=files", f"data.source.files=[{tmp_path}/nope.jsonl]", f"data.dir={tmp_path}/out")
    assert result.returncode == 2 and f"no such file {tmp_path}/nope.jsonl" in result.stderr


# -- checks before training: each corrupt case is one clear error naming the file and the fix


def datamodule(dir, *overrides):
    return instantiate(compose_config("train", [f"data.dir={dir}", *overrides]).data)


def test_missing_token_file(prepared_copy):
    (prepared_copy / "val.bin").unlink()
    with pytest.raises(DataError, match=r"val.bin is missing: run `normlab-prepare data=embedded`"):
        datamodule(prepared_copy).verify()


def test_token_outside_the_vocabulary(prepared_copy):
    tokens = np.memmap(prepared_copy / "train.bin", dtype=np.uint16, mode="r+")
    tokens[12345] = 60000
    tokens.flush()
    with pytest.raises(DataError, match=r"train.bin holds token 60000 at position 12345, outside the vocabulary of 50257"):
        datamodule(prepared_copy).verify()


def test_checksum_mismatch_on_request(prepared_copy):
    tokens = np.memmap(prepared_copy / "train.bin", dtype=np.uint16, mode="r+")
    tokens[777] = (int(tokens[777]) + 1) % 50000
    tokens.flush()
    datamodule(prepared_copy).verify()  # same size, valid tokens: only the checksum can tell
    with pytest.raises(DataError, match=r"train.bin does not match the sha256 in .*meta.json"):
        datamodule(prepared_copy, "data.verify_checksums=true").verify()


def test_tokenizer_other_than_the_models(prepared_copy):
    with pytest.raises(DataError, match=r"model expects GPT-2 with vocab_size=50304"):
        datamodule(prepared_copy, "model.vocab_size=50304").verify()
    meta = json.loads((prepared_copy / "meta.json").read_text())
    meta["tokenizer"].update(name="cl100k_base", ranks_sha256="0" * 64)
    (prepared_copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"tokenized with cl100k_base"):
        datamodule(prepared_copy).verify()


def test_validation_budget_larger_than_the_split(prepared_copy):
    with pytest.raises(DataError, match=r"data.val_tokens=10000000 but the validation split"):
        datamodule(prepared_copy, "data.val_tokens=10000000").verify()


def test_corrupt_data_stops_training_in_one_line(prepared_copy, tmp_path):
    with open(prepared_copy / "train.bin", "r+b") as f:
        f.truncate(4096)
    result = run_cli("normlab-train", f"data.dir={prepared_copy}", f"run_dir={tmp_path / 'run'}", "logger=csv")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "train.bin holds 2048 tokens, its metadata says" in line and "normlab-prepare data=embedded" in line
    assert not (tmp_path / "run").exists()
