"""The hub's datasets as they are today, read with the datasets and huggingface_hub a fresh install gets: OpenWebText's
original archives without its loading script, a script-free parquet conversion, a repository of only a script, and
Wikipedia's probe set streamed; from the hub (tests/hub.py serves planted replicas, tests/replicas.py, over the hub's
HTTP API), offline from the Hugging Face cache, and from a local copy; and what a kill costs."""

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import BIN, compose_config, run_cli
from hub import Hub
from normlab.data import prepare, tokenizer
from replicas import (
    SCRIPT,
    assert_prepared_from,
    nanogpt_split,
    owt,
    plant_openwebtext,
    plant_parquet,
    plant_wikipedia,
    tokens_of,
)

OWT = "Skylion007/openwebtext"
ARCHIVES = [f"subsets/urlsf_subset{a:02d}.tar" for a in range(3)]


def prepare_here(overrides: list[str]) -> dict:
    """normlab-prepare in this process (the code of the command, without its start-up)."""
    config = compose_config("prepare", overrides)
    return prepare.prepare(config.data, num_proc=config.num_proc)


def corpus(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def token_files(folder: Path) -> dict[str, bytes]:
    """The corpus but its meta.json (which records the source's path)."""
    return {name: data for name, data in corpus(folder).items() if name != "meta.json"}


@pytest.fixture
def hub():
    servers = []

    def serve(repos: dict[str, dict[str, Path]]) -> Hub:
        servers.append(Hub(repos))
        return servers[-1]

    yield serve
    for server in servers:
        server.close()


def hub_env(hub: Hub, tmp_path: Path, **more: str) -> dict:
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), **more}


# -- the archives, read as the loading script read them


def test_archives_are_read_as_the_loading_script_read_them(tmp_path, prepared, capsys):
    """A local copy of the original layout: each document normalised as the script did, non-.xz and non-.txt members
    and hidden files skipped, in archive then member order; the same bytes with one reading process or two, and the
    same as datasets' reading of a script-free parquet conversion of the same documents."""
    documents = plant_openwebtext(tmp_path / "copy")
    assert len(documents) == 24 and "First part.\n\nSecond part, Zürich 東京" in documents
    counts = {"documents": 24, "train": len(tokens_of(nanogpt_split(documents)["train"])),
              "val": len(tokens_of(nanogpt_split(documents)["val"]))}
    expected = [f"+data.source.expected.documents={counts['documents']}",
                f"+data.source.expected.tokens={{train: {counts['train']}, val: {counts['val']}}}"]
    prepare_here([*owt(tmp_path / "two", f"data.source.path={tmp_path / 'copy'}"), *expected])
    assert_prepared_from(tmp_path / "two", documents)
    out, err = capsys.readouterr()
    assert f"as expected: 24 documents, train {counts['train']:,} tokens, val {counts['val']:,} tokens" in out
    assert "warning" not in err
    for a in range(3):
        assert f"archive {a + 1}/3 urlsf_subset{a:02d}.tar: 8 documents, " in out

    prepare_here([*owt(tmp_path / "one", f"data.source.path={tmp_path / 'copy'}"), "num_proc=1"])
    plant_parquet(tmp_path / "converted", documents)
    prepare_here(owt(tmp_path / "parquet", f"data.source.path={tmp_path / 'converted'}"))
    assert token_files(tmp_path / "one") == token_files(tmp_path / "two") == token_files(tmp_path / "parquet")


def test_counts_unlike_the_published_corpus_are_a_warning(tmp_path, prepared, capsys):
    documents = plant_openwebtext(tmp_path / "copy", archives=1)
    train, val = (len(tokens_of(part)) for part in nanogpt_split(documents).values())
    prepare_here([*owt(tmp_path / "out", f"data.source.path={tmp_path / 'copy'}"), "+data.source.expected={"
                  f"documents: 9, tokens: {{train: 100, val: {val}}}}}"])
    assert_prepared_from(tmp_path / "out", documents)  # a warning, not an error: the corpus is written
    assert [line for line in capsys.readouterr().err.splitlines() if "warning" in line] == [
        "warning: openwebtext: 8 documents, where the published corpus has 9 (-1): a partial copy or conversion, or "
        "another version",
        f"warning: openwebtext: the train split holds {train:,} tokens, where the reference preparation has 100 "
        f"({(train - 100) / 100:+.2%})",
    ]


# -- from the hub: fetched once, read offline from the cache, a fetch killed midway


def test_openwebtext_from_the_hub_is_fetched_once_then_read_offline(tmp_path, prepared, hub):
    documents = plant_openwebtext(tmp_path / "repo")
    server = hub({OWT: {"main": tmp_path / "repo"}})
    env = hub_env(server, tmp_path)
    first = run_cli("normlab-prepare", *owt(tmp_path / "first"), env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert_prepared_from(tmp_path / "first", documents)
    sizes = {name: (tmp_path / "repo" / name).stat().st_size for name in ARCHIVES}
    assert dict(server.sent) == sizes  # the archives, each once; not the script, nor anything else
    lines = first.stdout.splitlines()  # a line per archive, in a log as on a terminal; no carriage returns
    assert [line.split(":")[0] for line in lines if line.startswith("archive ")] == [
        f"archive {a + 1}/3 urlsf_subset{a:02d}.tar" for a in range(3)]
    assert "\r" not in first.stdout + first.stderr and "HTTP Request" not in first.stdout

    again = run_cli("normlab-prepare", *owt(tmp_path / "again"), env=env)
    offline = run_cli("normlab-prepare", *owt(tmp_path / "offline"), env={**env, "HF_HUB_OFFLINE": "1"})
    assert again.returncode == 0 and offline.returncode == 0, again.stderr[-2000:] + offline.stderr[-2000:]
    assert dict(server.sent) == sizes  # nothing fetched again
    assert corpus(tmp_path / "again") == corpus(tmp_path / "first")
    assert token_files(tmp_path / "offline") == token_files(tmp_path / "first")

    # what `hf download --local-dir` leaves (the script, the card, the archives, its .cache/ folder): a local copy
    download = subprocess.run([BIN / "hf", "download", "--repo-type", "dataset", OWT, "--local-dir", tmp_path / "copy"],
                              env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert download.returncode == 0 and (tmp_path / "copy" / ".cache").is_dir(), download.stderr[-2000:]
    prepare_here(owt(tmp_path / "from-copy", f"data.source.path={tmp_path / 'copy'}"))
    assert token_files(tmp_path / "from-copy") == token_files(tmp_path / "first")


def test_a_fetch_killed_midway_costs_only_the_archive_it_cut(tmp_path, prepared, hub):
    """Killed while the third archive comes in (the first two in the cache): the next prepare fetches the third
    again from its start (huggingface_hub keeps no partial file) and none of the others; the corpus is a clean run's."""
    documents = plant_openwebtext(tmp_path / "repo")
    server = hub({OWT: {"main": tmp_path / "repo"}})
    sizes = {name: (tmp_path / "repo" / name).stat().st_size for name in ARCHIVES}
    server.stall[ARCHIVES[2]] = sizes[ARCHIVES[2]] // 2
    env = {**os.environ, "WANDB_MODE": "offline", **hub_env(server, tmp_path)}
    out = tmp_path / "out"
    with subprocess.Popen([BIN / "normlab-prepare", *owt(out)], env=env, start_new_session=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as killed:
        deadline = time.monotonic() + 120
        while not (server.sent[ARCHIVES[0]] == sizes[ARCHIVES[0]] and server.sent[ARCHIVES[1]] == sizes[ARCHIVES[1]]
                   and server.sent[ARCHIVES[2]] > 0):
            assert killed.poll() is None and time.monotonic() < deadline, "the fetch ended before it could be killed"
            time.sleep(0.02)
        time.sleep(0.2)
        os.killpg(killed.pid, signal.SIGKILL)
    cut = server.sent[ARCHIVES[2]]
    assert 0 < cut < sizes[ARCHIVES[2]] and not out.exists()
    del server.stall[ARCHIVES[2]]
    offline = run_cli("normlab-prepare", *owt(out), env=hub_env(server, tmp_path, HF_HUB_OFFLINE="1"))
    assert error_line(offline) == (
        f"normlab-prepare: error: the Hugging Face cache holds only some of the archives of '{OWT}' (a fetch cut "
        "short): run `normlab-prepare data=openwebtext` with network, which fetches the rest")
    assert not out.exists()

    result = run_cli("normlab-prepare", *owt(out), env=hub_env(server, tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert dict(server.sent) == {**sizes, ARCHIVES[2]: cut + sizes[ARCHIVES[2]]}
    assert_prepared_from(out, documents)


def test_a_read_killed_midway_keeps_the_previous_corpus_and_the_next_equals_a_clean_run(tmp_path, prepared):
    copy = tmp_path / "copy"
    documents = plant_openwebtext(copy, archives=2, members=12, documents=40, words=300)
    out = tmp_path / "corpus"
    clean = run_cli("normlab-prepare", *owt(out, f"data.source.path={copy}"))
    assert clean.returncode == 0, clean.stderr[-3000:]
    before = corpus(out)
    first_archive = 2 * len(tokens_of(documents[: 12 * 40]))  # bytes of the first archive's tokens

    with subprocess.Popen([BIN / "normlab-prepare", *owt(out, f"data.source.path={copy}")], start_new_session=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as killed:
        deadline = time.monotonic() + 120
        while not any(p.stat().st_size for p in out.parent.glob(f".{out.name}.staging-*/documents.bin.tmp")):
            assert killed.poll() is None and time.monotonic() < deadline, "the read ended before it could be killed"
            time.sleep(0.005)
        os.killpg(killed.pid, signal.SIGKILL)
    (read,) = out.parent.glob(f".{out.name}.staging-*/documents.bin.tmp")
    assert 0 < read.stat().st_size < first_archive  # killed within the first archive
    assert corpus(out) == before

    again = run_cli("normlab-prepare", *owt(out, f"data.source.path={copy}"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert corpus(out) == before and not list(out.parent.glob(f".{out.name}.staging-*"))
    assert_prepared_from(out, documents)


# -- a repository that is only a loading script, or holds neither layout


def test_a_script_is_never_run_and_the_way_out_is_named(tmp_path, prepared, hub):
    """A hub repository of only a loading script: the hub's parquet conversion where it has one (then read with
    data.source.revision=refs/convert/parquet), else the data as local files; never the network advice."""
    (tmp_path / "script").mkdir()
    (tmp_path / "script" / SCRIPT).write_text("raise SystemExit('a loading script must never run')\n")
    (tmp_path / "script" / "README.md").write_text("# a dataset card\n")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "loader.py").write_text("raise SystemExit('a loading script must never run')\n")
    documents = [f"Converted document {i}: café {i * 7}" for i in range(12)]
    plant_parquet(tmp_path / "converted", documents, files=1)
    (tmp_path / "converted" / "README.md").unlink()  # the conversion's branch: {config}/{split} folders, no card
    (tmp_path / "converted" / "plain_text" / "train-00000-of-00001.parquet").rename(
        tmp_path / "converted" / "plain_text" / "partial-train.parquet")
    (tmp_path / "converted" / "plain_text" / "partial-train").mkdir()
    (tmp_path / "converted" / "plain_text" / "partial-train.parquet").rename(
        tmp_path / "converted" / "plain_text" / "partial-train" / "0000.parquet")
    server = hub({OWT: {"main": tmp_path / "script", "refs/convert/parquet": tmp_path / "converted"},
                  "org/other": {"main": tmp_path / "other"}})
    env = hub_env(server, tmp_path)

    converted = run_cli("normlab-prepare", *owt(tmp_path / "a"), env=env)
    other = run_cli("normlab-prepare", "data=hub", "data.source.path=org/other", f"data.dir={tmp_path / 'b'}", env=env)
    assert error_line(converted) == (
        f"normlab-prepare: error: '{OWT}' on the Hugging Face hub holds a loading script ({SCRIPT}), which datasets no "
        "longer runs: read the hub's parquet conversion of it instead: data.source.revision=refs/convert/parquet")
    assert error_line(other) == (
        "normlab-prepare: error: 'org/other' on the Hugging Face hub holds a loading script (loader.py), which "
        "datasets no longer runs: the hub has no parquet conversion of it: prepare its data as local files: "
        "`normlab-prepare data=files 'data.source.files=[...]'` (docs/data.md)")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

    result = run_cli("normlab-prepare", *owt(tmp_path / "a", "data.source.revision=refs/convert/parquet"), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_prepared_from(tmp_path / "a", documents)


def test_a_name_or_revision_the_hub_lacks_and_an_unreachable_hub_are_one_line_each(tmp_path, hub):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "data.jsonl").write_text('{"text": "a document"}\n')
    server = hub({"org/corpus": {"main": tmp_path / "repo"}})
    closed = Hub({})
    closed.close()  # a port where nothing listens
    cases = {
        "no dataset 'org/nothing' on the Hugging Face hub that this machine may read (private or gated ones need "
        "`hf auth login`): check data.source.path": (["data.source.path=org/nothing"], server.url),
        "'org/corpus' on the Hugging Face hub has no revision 'v9': give a branch, tag or commit of it as "
        "data.source.revision (refs/convert/parquet: the hub's parquet conversion)": (
            ["data.source.path=org/corpus", "data.source.revision=v9"], server.url),
        "the Hugging Face hub is unreachable (no network?) for 'org/corpus': prepare it on a machine with network (a "
        "login node): `normlab-prepare data=hub`, then copy data/hub/ here; with HF_HUB_OFFLINE or "
        "HF_DATASETS_OFFLINE=1 a dataset already in the Hugging Face cache is used without network": (
            ["data.source.path=org/corpus"], closed.url),
    }
    for message, (overrides, url) in cases.items():
        result = run_cli("normlab-prepare", "data=hub", f"data.dir={tmp_path / 'out'}", *overrides,
                         env={"HF_ENDPOINT": url, "HF_HOME": str(tmp_path / "hf-home")})
        assert error_line(result) == f"normlab-prepare: error: {message}"
        assert not (tmp_path / "out").exists()


def error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.stderr.strip().splitlines()[-1] == line
    return line


def neither(folder: Path) -> None:
    (folder / "docs").mkdir(parents=True)
    (folder / "README.md").write_text("# a card\n")
    (folder / "docs" / "corpus.zip").write_bytes(b"PK\x05\x06" + bytes(18))


def script_and_data(folder: Path) -> None:
    folder.mkdir()
    (folder / "corpus.py").write_text("raise SystemExit('never run')\n")
    for i in range(5):
        (folder / f"part{i}.jsonl").write_text('{"text": "a"}\n')


def cut_archive(folder: Path) -> None:
    """The original layout with its second archive cut in half (a copy that stopped midway)."""
    plant_openwebtext(folder)
    archive = folder / ARCHIVES[1]
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])


def data_files(folder: Path) -> None:
    folder.mkdir()
    (folder / "data.jsonl").write_text('{"text": "a document"}\n')


@pytest.mark.parametrize("case, plant, overrides, message", [
    ("a configuration that datasets cannot find", data_files, ["data.source.name=nope"],
     "datasets cannot read '{folder}' (ValueError: BuilderConfig 'nope' not found. Available: ['default']): check "
     "data.source's name, split and revision"),
    ("a cut archive", cut_archive, [],
     f"{{folder}}/{ARCHIVES[1]} ends before its last member or its end-of-archive marker (a copy cut short): the "
     "archive is damaged: delete it (from the Hugging Face cache, or the copy) and fetch it again"),
    ("a probe set of archives", plant_openwebtext, ["+data.source.probe_tokens=100"],
     "data 'openwebtext': a probe set is read from data files, and {folder} holds archives: give a source with data "
     "files (parquet, json, ...)"),
    ("neither layout", neither, [],
     "the folder {folder} holds no data files (parquet, arrow, json, csv or text) or archives matching "
     "subsets/urlsf_subset*.tar; it holds README.md, docs/corpus.zip: give data.source.path a dataset repository, "
     "or a copy of one, with its data files"),
    ("a script beside data files", script_and_data, [],
     "the folder {folder} holds a loading script (corpus.py), beside data files (part0.jsonl, part1.jsonl, "
     "part2.jsonl, ...), which datasets no longer runs: read the hub's parquet conversion of it where it has one "
     "(data.source.path=ORG/NAME data.source.revision=refs/convert/parquet), or prepare its data as local files: "
     "`normlab-prepare data=files 'data.source.files=[...]'` (docs/data.md)"),
    ("no such folder", None, [],
     "data.source.path={folder}: no such folder, and not a dataset's name on the hub (org/name): give a local copy "
     "of the dataset's repository or its name"),
    ("a revision of a local copy", neither, ["data.source.revision=v1"],
     "data.source.path={folder} is a local folder, and data.source.revision=v1 names a version on the hub: leave "
     "the revision out (null) for a local copy"),
])
def test_a_local_copy_that_cannot_be_read_is_one_line(tmp_path, case, plant, overrides, message):
    folder = tmp_path / "copy"
    if plant:
        plant(folder)
    out = tmp_path / "out"
    result = run_cli("normlab-prepare", *owt(out, f"data.source.path={folder}", *overrides))
    assert error_line(result) == "normlab-prepare: error: " + message.format(folder=folder)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


# -- the probe set: Wikipedia streamed from the hub, or read from a local copy


def test_the_wikipedia_probe_is_the_same_streamed_from_the_hub_or_read_from_a_copy(tmp_path, prepared, hub):
    articles = plant_wikipedia(tmp_path / "repo")
    plant_wikipedia(tmp_path / "bare", card=False)  # its parquet files copied alone, without the card
    server = hub({"wikimedia/wikipedia": {"main": tmp_path / "repo"}})
    probe = ["data=wikipedia", "data.source.probe_tokens=3000", "data.source.probe_buffer=40"]
    streamed = run_cli("normlab-prepare", *probe, f"data.dir={tmp_path / 'streamed'}", env=hub_env(server, tmp_path))
    assert streamed.returncode == 0, streamed.stderr[-3000:]
    assert not [p for p in (tmp_path / "hf-home").rglob("*") if p.is_file() and p.stat().st_size > 1000]  # streamed
    for copy in ("repo", "bare"):
        prepare_here([*probe, f"data.source.path={tmp_path / copy}", f"data.dir={tmp_path / copy}-probe"])
        assert (tmp_path / f"{copy}-probe" / "probe.bin").read_bytes() == (
            tmp_path / "streamed" / "probe.bin").read_bytes()
    tokens = np.fromfile(tmp_path / "streamed" / "probe.bin", dtype=np.uint16)
    encoding = tokenizer.gpt2()
    whole = encoding.decode(tokens.tolist()).split("<|endoftext|>")[:-1]  # the last article is cut at 3,000 tokens
    assert len(tokens) == 3000 and whole and all(article in articles for article in whole)
    assert whole != articles[: len(whole)]  # a seeded sample, not the dump's first articles
