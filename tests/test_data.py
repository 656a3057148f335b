"""The embedded corpus: real GPT-2 BPE tokens in uint16 files with metadata, checked before training."""

import json

import numpy as np
import pytest
from hydra.utils import instantiate

from conftest import compose_config
from normlab.common.errors import DataError
from normlab.data import tokenizer


def test_offline_tokenizer_is_gpt2(prepared):
    enc = tokenizer.gpt2()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257 and enc.eot_token == 50256
    assert enc.decode([15496, 995]) == "Hello world"


def test_prepared_files_match_their_metadata(prepared):
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["tokenizer"]["ranks_sha256"] == tokenizer.RANKS_SHA256
    for split in ("train", "val"):
        info = meta["splits"][split]
        tokens = np.fromfile(prepared / info["file"], dtype=np.uint16)
        assert tokens.size == info["tokens"] > 10_000
        assert tokens.max() < 50257
        assert (tokens == tokenizer.EOT).sum() == info["documents"]  # one EOT closes every document
        assert tokens[-1] == tokenizer.EOT
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 42


def test_prepared_text_decodes_to_english(prepared):
    tokens = np.fromfile(prepared / "val.bin", dtype=np.uint16)[:2000]
    text = tokenizer.gpt2().decode(tokens.tolist())
    assert " the " in text and " and " in text


def datamodule(dir):
    return instantiate(compose_config("train", [f"data.dir={dir}"]).data)


def test_truncated_token_file_is_refused(prepared_copy):
    with open(prepared_copy / "train.bin", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(DataError, match=r"train.bin holds 500 tokens.*truncated.*normlab-prepare data=embedded"):
        datamodule(prepared_copy).verify()


def test_other_source_is_refused(prepared_copy):
    meta = json.loads((prepared_copy / "meta.json").read_text())
    meta["source"]["split_seed"] = 1
    (prepared_copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="another source"):
        datamodule(prepared_copy).verify()


def test_a_source_key_added_since_a_corpus_was_prepared_is_the_same_source_while_null(prepared_copy):
    """data.source.revision and .archives came after corpora were prepared without them: left null, the corpus is
    still the configured source's; set, it is not."""
    instantiate(compose_config("train", [f"data.dir={prepared_copy}", "+data.source.revision=null"]).data).verify()
    with pytest.raises(DataError, match="another source"):
        instantiate(compose_config("train", [f"data.dir={prepared_copy}", "+data.source.revision=v1"]).data).verify()


def test_windows_are_consecutive_tokens_with_shifted_targets(prepared):
    dm = datamodule(prepared)
    dm.setup("fit")
    tokens = np.fromfile(prepared / "train.bin", dtype=np.uint16)
    x, y = dm.train_windows[3]
    seq = dm.seq_len
    assert np.array_equal(x.numpy(), tokens[3 * seq : 4 * seq]) and np.array_equal(
        y.numpy(), tokens[3 * seq + 1 : 4 * seq + 1]
    )
    assert len(dm.val_windows) == dm.val_tokens // seq


def test_no_tokenizer_offline_is_one_clear_error(tmp_path, monkeypatch):
    from normlab.common.errors import TokenizerError

    monkeypatch.setattr(tokenizer, "RANKS_FILE", tmp_path / "missing.tiktoken")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # no network: every download is refused at once
    with pytest.raises(TokenizerError, match="no GPT-2 tokenizer available offline.*normlab-prepare"):
        tokenizer.gpt2()
    with pytest.raises(TokenizerError, match="does not exist"):
        tokenizer.gpt2(tmp_path / "nope.tiktoken")


def test_tokenizer_uses_tiktokens_cache_or_a_given_file_offline(prepared, tmp_path, monkeypatch):
    import hashlib
    import shutil

    from normlab.common.errors import TokenizerError

    monkeypatch.setattr(tokenizer, "RANKS_FILE", tmp_path / "missing.tiktoken")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # no network
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    shutil.copy(
        tokenizer.DATA_DIR / "tokenizer" / "gpt2.tiktoken",
        cache / hashlib.sha1(tokenizer.TIKTOKEN_URL.encode()).hexdigest(),
    )
    assert tokenizer.gpt2().encode_ordinary("Hello world") == [15496, 995]
    given = shutil.copy(tokenizer.DATA_DIR / "tokenizer" / "gpt2.tiktoken", tmp_path / "ranks.tiktoken")
    assert tokenizer.gpt2(given).encode_ordinary("Hello world") == [15496, 995]
    (tmp_path / "bad.tiktoken").write_text("aGVsbG8= 0\n")
    with pytest.raises(TokenizerError, match="not the GPT-2 ranks file"):
        tokenizer.gpt2(tmp_path / "bad.tiktoken")
