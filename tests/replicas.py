"""Planted replicas of the hub's repositories, built by the tests in the layouts the hub holds them:

- OpenWebText's original layout (plant_openwebtext): its loading script, a dataset card, and subsets/urlsf_subsetNN.tar,
  each a tar of xz-compressed tars of .txt documents, with what the loading script skipped (members that are not .xz
  or .txt, hidden files, folders) and documents its normalisation changes (four newlines in a row, outer blank lines);
- a script-free conversion of the same documents to parquet (plant_parquet), in the same order;
- Wikipedia's (plant_wikipedia): a dataset card declaring the configuration 20231101.en and its parquet files.

Each returns the documents a reader should find, in order; assert_prepared_from checks that a prepared corpus holds
exactly them.
"""

import io
import json
import math
import random
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from normlab.data import tokenizer

SCRIPT = "openwebtext.py"
CARD = "---\nlicense: cc0-1.0\n---\n# OpenWebText (a replica for the tests)\n"
WORDS = ("the model layer norm mean vector angle uniform hidden state residual stream token corpus training run "
         "naïve café Zürich 東京 español").split()


def add(tar: tarfile.TarFile, name: str, data: bytes | None) -> None:
    """A regular file (or, for data None, a folder) in a tar."""
    info = tarfile.TarInfo(name)
    if data is None:
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    else:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def xz_tar(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=0) as tar:
        for name, data in members:
            add(tar, name, data)
    return buffer.getvalue()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def plant_openwebtext(folder: Path, archives: int = 3, members: int = 2, documents: int = 4, words: int = 30,
                      seed: int = 0) -> list[str]:
    """OpenWebText's layout in `folder`; the normalised documents in reading order."""
    rng = random.Random(seed)
    (folder / "subsets").mkdir(parents=True)
    (folder / SCRIPT).write_text("# the loading script, which datasets no longer runs\n")
    (folder / "README.md").write_text(CARD)
    expected = []
    for a in range(archives):
        with tarfile.open(folder / "subsets" / f"urlsf_subset{a:02d}.tar", "w") as outer:
            add(outer, "openwebtext", None)
            add(outer, "openwebtext/README", b"not an xz member: skipped\n")
            for m in range(members):
                inner = []
                for d in range(documents):
                    body = text(rng, words)
                    if (a, m, d) == (0, 0, 1):  # four newlines in a row become two; outer blank lines go
                        raw = "\n\n  First part.\n\n\n\nSecond part, Zürich 東京  \n\n\n"
                        kept = "First part.\n\nSecond part, Zürich 東京"
                    elif d == 2:  # a run of three newlines, inside a document of the usual kind
                        raw, kept = f"{body}\n\n\n{body}\n", f"{body}\n\n{body}"
                    else:
                        raw, kept = f"{body}\n", body
                    inner.append((f"{a:04d}{m:03d}-{d}.txt", raw.encode()))
                    expected.append(kept)
                inner.insert(1, ("notes.json", b'{"not": "a document"}'))  # not .txt: skipped
                inner.append((".hidden.txt", b"a hidden file: skipped"))
                add(outer, f"openwebtext/urlsf_subset{a:02d}-{m}_data.xz", xz_tar(inner))
    return expected


def plant_parquet(folder: Path, documents: list[str], files: int = 2) -> None:
    """The documents as a script-free conversion to parquet leaves them: plain_text/train-*.parquet in order, and a
    dataset card declaring them."""
    (folder / "plain_text").mkdir(parents=True)
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: plain_text\n  data_files:\n  - split: train\n"
                                      "    path: plain_text/train-*\n---\n# OpenWebText\n")
    per_file = -(-len(documents) // files)
    for i in range(files):
        part = documents[i * per_file: (i + 1) * per_file]
        pq.write_table(pa.table({"text": part}), folder / "plain_text" / f"train-{i:05d}-of-{files:05d}.parquet")


def plant_wikipedia(folder: Path, files: int = 4, articles: int = 30, seed: int = 1, card: bool = True) -> list[str]:
    """Wikipedia's layout: 20231101.en/train-*.parquet (id, url, title, text), with the dataset card that declares
    the configuration (card=False: its parquet files copied alone)."""
    rng = random.Random(seed)
    (folder / "20231101.en").mkdir(parents=True)
    if card:
        (folder / "README.md").write_text("---\nconfigs:\n- config_name: 20231101.en\n  data_files:\n  - split: train\n"
                                          "    path: 20231101.en/train-*\n---\n# Wikipedia\n")
    texts = []
    for i in range(files):
        rows = [text(rng, rng.randint(20, 80)) for _ in range(articles)]
        ids = [str(i * articles + j) for j in range(articles)]
        pq.write_table(pa.table({"id": ids, "url": [f"https://en.wikipedia.org/wiki?curid={n}" for n in ids],
                                 "title": [f"Article {n}" for n in ids], "text": rows}),
                       folder / "20231101.en" / f"train-{i:05d}-of-{files:05d}.parquet")
        texts += rows
    return texts


# -- what a prepared corpus of them holds


def owt(out: Path, *more: str) -> list[str]:
    """normlab-prepare's arguments for the planted OpenWebText: a quarter held out, no check against the real
    corpus's counts."""
    return ["data=openwebtext", f"data.dir={out}", "data.source.val_fraction=0.25", "~data.source.expected", *more]


def nanogpt_split(documents: list[str], val_fraction: float = 0.25, seed: int = 2357) -> dict[str, list[str]]:
    """nanoGPT's split (datasets' train_test_split), computed here: a permutation of the documents by numpy's default
    generator seeded with `seed`, its first ceil(fraction x n) held out; each split in the permutation's order."""
    order = np.random.default_rng(seed).permutation(len(documents))
    held = math.ceil(val_fraction * len(documents))
    return {"train": [documents[i] for i in order[held:]], "val": [documents[i] for i in order[:held]]}


def tokens_of(documents: list[str]) -> list[int]:
    encoding = tokenizer.gpt2()
    return [t for doc in documents for t in [*encoding.encode_ordinary(doc), tokenizer.EOT]]


def assert_prepared_from(folder: Path, documents: list[str]) -> None:
    """The corpus in `folder` holds exactly the GPT-2 tokens of `documents`, EOT after each, split as nanoGPT splits
    them, with meta.json's counts."""
    meta = json.loads((folder / "meta.json").read_text())
    for name, part in nanogpt_split(documents).items():
        tokens = np.fromfile(folder / f"{name}.bin", dtype=np.uint16).tolist()
        assert tokens == tokens_of(part), name
        assert meta["splits"][name]["tokens"] == len(tokens) and meta["splits"][name]["documents"] == len(part)
