"""OpenWebText's original layout, read as its loading script read it, without running the script: tar archives
(subsets/urlsf_subset00.tar ...) of xz-compressed tars of .txt documents.

Every document is normalised as the script did (runs of three or more newlines become two; stripped), and members
that are not .xz (outer) or .txt (inner) are skipped, as are hidden files. Documents keep a fixed order, archive by
archive, member by member, whatever the number of processes: `num_proc` processes each read and tokenize one xz
member at a time, and their tokens are written in order to one file. The documents are then split as datasets'
seeded train_test_split splits a dataset of them in that order (the split `data=hub` gives the same documents as
data files), and each split's documents are copied, in the split's order, into its token file.
"""

import io
import lzma
import multiprocessing
import os
import re
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import tiktoken

from normlab.common.errors import DataError
from normlab.common.progress import Progress
from normlab.data import tokenizer
from normlab.data.token_file import TokenFile

NEWLINES = re.compile("\n\n\n+")
DOCUMENTS_FILE = "documents.bin.tmp"  # every document's tokens in reading order, removed once split
GATHER_BLOCK = 4096  # documents copied into a split file at a time
DAMAGED = "the archive is damaged: delete it (from the Hugging Face cache, or the copy) and fetch it again"
encoding: tiktoken.Encoding | None = None  # the tokenizer of a reading process


def normalise(text: str) -> str:
    """A document as OpenWebText's loading script gave it."""
    return NEWLINES.sub("\n\n", text).strip()


@dataclass(frozen=True)
class Member:
    """An xz-compressed tar of documents inside an archive: where its bytes lie."""

    archive: Path
    name: str
    offset: int
    size: int


def kept(member: tarfile.TarInfo) -> bool:
    """A member the loading script read (datasets' iter_archive): a regular file, not hidden."""
    return member.isreg() and not os.path.basename(member.name).startswith((".", "__"))


def members(archive: Path) -> list[Member]:
    """The archive's .xz members, in their order (their headers only are read). An archive cut short is refused:
    tarfile takes the end of the file for the end of the archive."""
    try:
        with tarfile.open(archive, "r:") as tar:
            listed = list(tar)
        end = max((m.offset_data + -(-m.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE for m in listed), default=0)
        with open(archive, "rb") as f:
            f.seek(end)
            marker = f.read(2 * tarfile.BLOCKSIZE)  # two zero blocks close a tar archive
    except (tarfile.TarError, OSError) as e:
        raise DataError(f"{archive} cannot be read as a tar archive ({e}): {DAMAGED}") from None
    if marker != bytes(2 * tarfile.BLOCKSIZE):
        raise DataError(f"{archive} ends before its last member or its end-of-archive marker (a copy cut short): "
                        f"{DAMAGED}")
    return [Member(archive, m.name, m.offset_data, m.size) for m in listed if kept(m) and m.name.endswith(".xz")]


def write_archive(path: Path, members: list[list[str]], preset: int = 6) -> None:
    """An archive in this layout, each of `members` an xz-compressed tar of its documents (normlab-bench measures
    reading one)."""
    with tarfile.open(path, "w") as outer:
        for m, texts in enumerate(members):
            packed = io.BytesIO()
            with tarfile.open(fileobj=packed, mode="w:xz", preset=preset) as inner:
                for d, text in enumerate(texts):
                    data = text.encode()
                    info = tarfile.TarInfo(f"{m:04d}-{d:03d}.txt")
                    info.size = len(data)
                    inner.addfile(info, io.BytesIO(data))
            info = tarfile.TarInfo(f"openwebtext/{path.stem}-{m}_data.xz")
            info.size = packed.tell()
            outer.addfile(info, io.BytesIO(packed.getvalue()))


def documents(member: Member) -> list[str]:
    """The normalised .txt documents of one xz member, in their order."""
    with open(member.archive, "rb") as f:
        f.seek(member.offset)
        data = f.read(member.size)
    texts = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|xz") as tar:
            for inner in tar:
                if kept(inner) and inner.name.endswith(".txt"):
                    raw = tar.extractfile(inner).read()
                    try:
                        texts.append(normalise(raw.decode("utf-8")))
                    except UnicodeDecodeError as e:
                        raise DataError(f"{member.archive}: {member.name}: {inner.name} is not UTF-8 (byte "
                                        f"0x{raw[e.start]:02x} at offset {e.start}): {DAMAGED}") from None
    except (tarfile.TarError, lzma.LZMAError, EOFError) as e:
        raise DataError(f"{member.archive}: {member.name} is not an xz-compressed tar ({e}): {DAMAGED}") from None
    return texts


def tokenize(member: Member) -> tuple[np.ndarray, np.ndarray]:
    """The member's documents as GPT-2 tokens, each followed by EOT, and each document's length with its EOT."""
    ids = encoding.encode_ordinary_batch(documents(member), num_threads=1)
    lengths = np.fromiter((len(doc) + 1 for doc in ids), dtype=np.int64, count=len(ids))
    tokens = np.fromiter((t for doc in ids for t in (*doc, tokenizer.EOT)), dtype=np.uint16, count=int(lengths.sum()))
    return tokens, lengths


def start_reader(gpt2: tiktoken.Encoding) -> None:
    global encoding
    encoding = gpt2


def read(archives: list[Path], gpt2: tiktoken.Encoding, path: Path, num_proc: int) -> np.ndarray:
    """Every document of the archives tokenized into `path` in order; each document's length in tokens. A line per
    archive (documents, tokens, MB/s and the time left), and a bar over all of them."""
    listed = [members(a) for a in archives]
    total = sum(m.size for ms in listed for m in ms)
    units = [m for ms in listed for m in ms]
    ends = {id(ms[-1]): k for k, ms in enumerate(listed) if ms}  # the last member of archive k
    lengths: list[np.ndarray] = []
    done = {"documents": 0, "tokens": 0, "bytes": 0}
    archive_start = {"documents": 0, "tokens": 0, "bytes": 0, "time": time.perf_counter()}
    started = archive_start["time"]
    start_reader(gpt2)
    context = multiprocessing.get_context("fork")  # the readers inherit the tokenizer
    pool = context.Pool(num_proc, initializer=start_reader, initargs=(gpt2,)) if num_proc > 1 else None
    try:
        results = pool.imap(tokenize, units, chunksize=1) if pool else map(tokenize, units)
        with open(path, "wb") as out, Progress(total=total, desc="reading archives", unit="B", unit_scale=True,
                                               unit_divisor=1024) as bar:
            for member, (chunk, sizes) in zip(units, results):
                out.write(chunk.tobytes())
                lengths.append(sizes)
                done["documents"] += sizes.size
                done["tokens"] += chunk.size
                done["bytes"] += member.size
                bar.update(member.size)
                bar.set_postfix_str(f"{done['documents']:,} documents, {done['tokens'] / 1e6:,.1f}M tokens",
                                    refresh=False)
                if (k := ends.get(id(member))) is not None:
                    now = time.perf_counter()
                    bar.write(archive_line(archives[k], k, len(archives), done, archive_start, now, started, total))
                    archive_start = {**done, "time": now}
            out.flush()
            os.fsync(out.fileno())
    finally:
        if pool:
            pool.terminate()
    return np.concatenate(lengths) if lengths else np.zeros(0, np.int64)


def archive_line(archive: Path, k: int, n: int, done: dict, start: dict, now: float, started: float,
                 total: int) -> str:
    seconds = max(now - start["time"], 1e-9)
    megabytes = (done["bytes"] - start["bytes"]) / 1e6
    left = (total - done["bytes"]) * (now - started) / max(done["bytes"], 1)
    return (f"archive {k + 1}/{n} {archive.name}: {done['documents'] - start['documents']:,} documents, "
            f"{done['tokens'] - start['tokens']:,} tokens, {megabytes:,.1f} MB at {megabytes / seconds:,.1f} MB/s; "
            f"in all {done['documents']:,} documents, {done['tokens']:,} tokens, ETA {clock(left)}")


def clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def split(count: int, val_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Which documents go to train and val, in each split's order: datasets' train_test_split of `count` documents,
    as data files of the same documents in the same order would be split."""
    index = datasets.Dataset.from_dict({"document": np.arange(count)})
    try:
        parts = index.train_test_split(test_size=val_fraction, seed=seed)
    except ValueError as e:
        raise DataError(f"data.source.val_fraction={val_fraction} cannot split {count:,} documents ({e})"
                        .splitlines()[0]) from None
    return {name: np.asarray(parts[part].with_format("numpy")["document"])
            for name, part in (("train", "train"), ("val", "test"))}


def write_split(documents_file: Path, lengths: np.ndarray, chosen: np.ndarray, path: Path) -> dict:
    """The `chosen` documents' tokens, in that order, copied from the documents file into a token file."""
    tokens = np.memmap(documents_file, dtype=np.uint16, mode="r") if lengths.sum() else np.zeros(0, np.uint16)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    out = TokenFile(path)
    with Progress(total=len(chosen), desc=f"writing {path.name}", unit=" documents", unit_scale=True) as bar:
        for first in range(0, len(chosen), GATHER_BLOCK):
            block = chosen[first: first + GATHER_BLOCK]
            sizes = lengths[block]
            # each document's tokens: its start repeated over its length, plus the position within it
            within = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
            out.write(tokens[np.repeat(starts[block], sizes) + within], len(block))
            bar.update(len(block))
    return out.close()


def write_splits(archives: list[Path], gpt2: tiktoken.Encoding, folder: Path, val_fraction: float, seed: int,
                 num_proc: int) -> dict[str, dict]:
    """train.bin and val.bin of the archives' documents in `folder`; each split's record for meta.json."""
    documents_file = folder / DOCUMENTS_FILE
    lengths = read(archives, gpt2, documents_file, num_proc)
    chosen = split(len(lengths), val_fraction, seed)
    splits = {name: write_split(documents_file, lengths, chosen[name], folder / f"{name}.bin") for name in chosen}
    documents_file.unlink()
    return splits
