"""Preparation of local corpora with the real datasets + tiktoken code, and the checks before training."""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import tiktoken
from hydra.utils import instantiate
from omegaconf import OmegaConf
from tiktoken_ext import openai_public

from conftest import BIN, DOCS, compose_config, local_corpus_config, run_cli
from normlab.common import outputs
from normlab.common.errors import DataError
from normlab.data import prepare, tokenizer

OFFLINE = {"HF_DATASETS_OFFLINE": "1"}


def test_tokenizer_is_tiktokens_gpt2(prepared):
    ours = tokenizer.gpt2()
    # tiktoken's own GPT-2 split pattern and special token, with the ranks from our hash-checked file
    reference = tiktoken.Encoding(
        name="ref",
        pat_str=openai_public.r50k_pat_str,
        special_tokens={"<|endoftext|>": 50256},
        mergeable_ranks=ours._mergeable_ranks,
        explicit_n_vocab=50257,
    )
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
        assert (
            info["max_token"] == tokens.max() and tokenizer.sha256_file(local_corpus / info["file"]) == info["sha256"]
        )
        text = enc.decode(tokens.tolist())
        docs = text.split("<|endoftext|>")
        assert docs[-1] == "" and len(docs) - 1 == expected_docs  # an EOT after every document
        seen += docs[:-1]
        assert text == "".join(d + "<|endoftext|>" for d in docs[:-1])
    assert sorted(seen) == sorted(DOCS)
    assert meta["source"]["split_seed"] == 2357 and meta["tokenizer"]["ranks_sha256"] == tokenizer.RANKS_SHA256


def test_validation_split_is_deterministic(local_corpus, tmp_path):
    result = run_cli(
        "normlab-prepare", *local_corpus_config(local_corpus), f"data.dir={tmp_path}", env={"HF_DATASETS_OFFLINE": "1"}
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for split in ("train.bin", "val.bin"):
        assert (tmp_path / split).read_bytes() == (local_corpus / split).read_bytes()


def test_probe_set_is_the_first_tokens_of_the_documents_in_order(tmp_path, local_corpus):
    result = run_cli(
        "normlab-prepare",
        *local_corpus_config(local_corpus),
        f"data.dir={tmp_path}",
        "+data.source.probe_tokens=700",
        env={"HF_DATASETS_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    enc = tokenizer.gpt2()
    expected = [t for doc in DOCS for t in enc.encode_ordinary(doc) + [tokenizer.EOT]][:700]
    assert np.fromfile(tmp_path / "probe.bin", dtype=np.uint16).tolist() == expected
    assert json.loads((tmp_path / "meta.json").read_text())["splits"]["probe"]["tokens"] == 700


def test_a_probe_set_can_be_a_seeded_sample_of_whole_documents(tmp_path, local_corpus):
    """probe_sample_seed (the Wikipedia probe's setting): documents in a seeded random order, whole, each with its
    EOT; the same seed gives the same probe, another seed another one."""
    enc = tokenizer.gpt2()
    encoded = {tuple(enc.encode_ordinary(doc) + [tokenizer.EOT]) for doc in DOCS}
    probes = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        result = run_cli("normlab-prepare", *local_corpus_config(local_corpus), f"data.dir={tmp_path / name}",
                         "+data.source.probe_tokens=700", f"+data.source.probe_sample_seed={seed}",
                         env={"HF_DATASETS_OFFLINE": "1"})
        assert result.returncode == 0, result.stderr[-2000:]
        probes[name] = np.fromfile(tmp_path / name / "probe.bin", dtype=np.uint16).tolist()
    in_order = [t for doc in DOCS for t in enc.encode_ordinary(doc) + [tokenizer.EOT]][:700]
    assert probes["a"] == probes["b"] != probes["c"] and probes["a"] != in_order and len(probes["a"]) == 700
    for probe in probes.values():
        documents = " ".join(map(str, probe)).split(f" {tokenizer.EOT}")[:-1]  # the last one is cut at 700 tokens
        assert all(tuple(map(int, d.split())) + (tokenizer.EOT,) in encoded for d in documents if d.strip())


def test_hub_dataset_offline_fails_at_once_with_the_way_out(tmp_path):
    started = time.perf_counter()
    result = run_cli(
        "normlab-prepare",
        "data=openwebtext",
        f"data.dir={tmp_path / 'owt'}",
        env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert time.perf_counter() - started < 30
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "Skylion007/openwebtext" in line and "HF_HUB_OFFLINE" in line and "normlab-prepare data=openwebtext" in line
    assert not (tmp_path / "owt").exists()


def test_missing_local_file_is_named(tmp_path):
    result = run_cli(
        "normlab-prepare", "data=files", f"data.source.files=[{tmp_path}/nope.jsonl]", f"data.dir={tmp_path}/out"
    )
    assert result.returncode == 2 and f"no such file {tmp_path}/nope.jsonl" in result.stderr


# -- re-preparing over a corpus: it is replaced only by a complete new one


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def staging_dirs(directory: Path) -> list[Path]:
    return list(directory.parent.glob(f".{directory.name}.staging-*"))


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one-line error of a failed CLI run (datasets' progress bars may come before it)."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert [line for line in lines if "error:" in line] == lines[-1:], result.stderr[-2000:]
    return lines[-1]


@pytest.fixture
def good_corpus(local_corpus, tmp_path) -> Path:
    """A copy of the prepared local corpus, to prepare over."""
    return Path(shutil.copytree(local_corpus, tmp_path / "corpus"))


def test_failed_prepare_leaves_the_old_corpus_as_it_was(local_corpus, good_corpus):
    before = snapshot(good_corpus)
    result = run_cli(
        "normlab-prepare",
        *local_corpus_config(local_corpus),
        f"data.dir={good_corpus}",
        "+data.source.probe_tokens=10000000",
        env=OFFLINE,
    )  # fails after writing probe.bin
    assert "fewer than probe_tokens=10,000,000" in error_line(result)
    assert snapshot(good_corpus) == before and not staging_dirs(good_corpus)


def test_killed_prepare_leaves_the_old_corpus_and_the_next_prepare_its_leftovers(local_corpus, good_corpus, tmp_path):
    before = snapshot(good_corpus)
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"body": DOCS[i % len(DOCS)]}) + "\n" for i in range(20000)))
    config = [*local_corpus_config(local_corpus), f"data.dir={good_corpus}", f"data.source.files=[{big}]"]
    with subprocess.Popen(
        [BIN / "normlab-prepare", *config],
        env={**os.environ, **OFFLINE},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ) as killed:
        deadline = time.monotonic() + 120
        while not any(any(d.iterdir()) for d in staging_dirs(good_corpus)):  # until tokens are being written
            assert killed.poll() is None and time.monotonic() < deadline, "the prepare ended before it could be killed"
            time.sleep(0.01)
        os.killpg(killed.pid, signal.SIGKILL)  # the prepare and its tokenizer processes
    assert snapshot(good_corpus) == before and len(staging_dirs(good_corpus)) == 1

    result = run_cli("normlab-prepare", *local_corpus_config(local_corpus), f"data.dir={good_corpus}", env=OFFLINE)
    assert result.returncode == 0, result.stderr[-2000:]
    assert snapshot(good_corpus) == before and not staging_dirs(good_corpus)


def test_leftovers_of_dead_prepares_are_removed_or_put_back(tmp_path, capsys):
    dead = subprocess.Popen(["true"])
    dead.wait()
    here = f"{outputs.HOST}-"
    running, elsewhere = f".corpus.staging-{here}{os.getppid()}", ".corpus.staging-elsewhere-1"
    for name in (
        f".corpus.staging-{here}{dead.pid}",
        f".corpus.old-{here}{dead.pid}",
        f".corpus.staging-{here}{os.getpid()}",
        running,
        elsewhere,
    ):  # our pid: a dead prepare's, reused
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text(name)
    outputs.remove_leftovers(tmp_path / "corpus", "a prepare")
    assert (tmp_path / "corpus/meta.json").read_text() == f".corpus.old-{here}{dead.pid}"  # killed between the renames
    assert sorted(p.name for p in tmp_path.glob(".corpus.*")) == sorted([running, elsewhere])
    assert "is left by a prepare on elsewhere" in capsys.readouterr().err


def test_directory_holding_other_files_is_not_replaced(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    config = compose_config(
        "prepare", ["data=files", f"data.dir={tmp_path}", f"data.source.files=[{tmp_path}/nope.jsonl]"]
    )  # checked before the source
    with pytest.raises(DataError, match=r"holds notes.txt, which is not a corpus file.*give another data.dir="):
        prepare.prepare(config.data)


@pytest.mark.parametrize("where", ["under a file", "read-only"])
def test_unwritable_data_dir_fails_before_loading(tmp_path, where):
    """Checked before anything is read: the source named does not even exist."""
    (tmp_path / "file").write_text("")
    (tmp_path / "locked").mkdir(mode=0o555)
    out = tmp_path / ("file" if where == "under a file" else "locked") / "corpus"
    without_root_powers = []
    if where == "read-only" and os.geteuid() == 0:
        # Root writes anywhere, and `nobody` cannot run this interpreter (pyenv's, under /root, mode 0700): run as
        # root without its capabilities, which obeys the permission bits of the directories it owns.
        if not shutil.which("setpriv"):
            pytest.skip("needs setpriv (util-linux) to drop root's capabilities")
        without_root_powers = ["setpriv", "--bounding-set=-all", "--"]
    result = subprocess.run(
        [
            *without_root_powers,
            BIN / "normlab-prepare",
            "data=files",
            f"data.dir={out}",
            f"data.source.files=[{tmp_path}/nope.jsonl]",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    reason = f"{tmp_path / 'file'} is not a directory" if where == "under a file" else "Permission denied"
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"normlab-prepare: error: cannot write {out} ({reason}): give a writable data.dir= (or paths.data_dir=)"
    ]
    assert not out.exists()


# -- documents that are not text: one line naming the file and the line or row


@pytest.mark.parametrize("format", ["json", "text"])
def test_bytes_not_utf8_are_named_by_line_and_column(tmp_path, format):
    source = tmp_path / f"part1.{'jsonl' if format == 'json' else 'txt'}"
    lines = [json.dumps({"text": d}).encode() if format == "json" else d.encode() for d in DOCS[:6]]  # UTF-8 é, 🦊
    lines.append(b'{"text": "Caf\xe9"}' if format == "json" else b"Caf\xe9")  # latin1 é
    source.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out"
    result = run_cli(
        "normlab-prepare",
        "data=files",
        f"data.source.format={format}",
        f"data.source.files=[{source}]",
        f"data.dir={out}",
        env=OFFLINE,
    )
    column = 14 if format == "json" else 4
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"normlab-prepare: error: {source}, line 7: not UTF-8 (byte 0xe9 at column {column}): re-encode it as UTF-8 "
        "(iconv -f latin1 -t utf-8) or give its encoding: +data.source.load_kwargs.encoding=latin1"
    ]
    assert not out.exists() and not staging_dirs(out)


def test_null_text_is_named_by_file_and_row(tmp_path):
    parts = [tmp_path / "part0.jsonl", tmp_path / "part1.jsonl"]
    parts[0].write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:5]))
    parts[1].write_text("".join(json.dumps({"text": None if i == 3 else d}) + "\n" for i, d in enumerate(DOCS[5:10])))
    out = tmp_path / "out"
    result = run_cli(
        "normlab-prepare", "data=files", f"data.source.files=[{parts[0]},{parts[1]}]", f"data.dir={out}", env=OFFLINE
    )
    expected = f"{parts[1]}, row 4: the text column is null: fix or drop that row"
    assert error_line(result) == f"normlab-prepare: error: {expected}"
    assert not out.exists() and not staging_dirs(out)


@pytest.mark.parametrize("streaming", [False, True])
def test_null_text_in_a_hub_dataset_is_named_by_row_index(tmp_path, monkeypatch, streaming):
    dataset = tmp_path / "dataset"  # a local directory stands for the hub's
    dataset.mkdir()
    rows = [json.dumps({"text": None if i == 7 else d}) + "\n" for i, d in enumerate(DOCS)]
    (dataset / "data.jsonl").write_text("".join(rows))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    config = compose_config(
        "prepare",
        [
            "data=hub",
            f"data.source.path={dataset}",
            f"data.dir={tmp_path}/out",
            f"data.source.streaming={streaming}",
            "+data.source.probe_tokens=100000",
        ],
    )
    with pytest.raises(DataError, match=rf"^'{dataset}' \(train\), row index 7: the text column is null: fix or drop"):
        prepare.prepare(config.data)
    assert not (tmp_path / "out").exists() and not staging_dirs(tmp_path / "out")


def test_sdist_member_not_in_its_encoding_is_named(tmp_path, monkeypatch):
    archive = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in (("a.txt", "fine\n".encode()), ("b.txt", "ok\nCafé\n".encode("latin1"))):
            info = tarfile.TarInfo(f"pkg-1.0/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    monkeypatch.setattr(prepare, "fetch_sdist", lambda requirement, downloads: archive)
    source = OmegaConf.create({"kind": "sdist", "package": "pkg==1.0", "glob": "pkg-1.0/texts/*.txt"})
    expected = (
        f"{archive}: pkg-1.0/texts/b.txt, line 2: not UTF-8 (byte 0xe9 at column 4): give the encoding of the "
        "files, e.g. +data.source.encoding=latin1"
    )
    with pytest.raises(DataError, match=f"^{re.escape(expected)}$"):
        prepare.load_documents("pkg", source)
    source.encoding = "latin1"
    assert prepare.load_documents("pkg", source)["text"] == ["fine\n", "ok\nCafé\n"]


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
    with pytest.raises(
        DataError, match=r"train.bin holds token 60000 at position 12345, outside the vocabulary of 50257"
    ):
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
