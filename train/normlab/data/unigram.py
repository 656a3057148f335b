"""The learning check's yardstick: the held-out split's cross-entropy under the training split's token frequencies
(nats/token), what a model that learned token frequencies and nothing else would score. normlab-prepare keeps it in
meta.json; for a corpus prepared before it did, it is computed from the token files (a second on the embedded corpus,
nothing written)."""

import json
import math
from pathlib import Path

import numpy as np

SMOOTHING = 0.5  # added to every token's training count (Jeffreys): a held-out token never seen in training is
                 # not infinitely surprising
KEY = "unigram_cross_entropy"  # in meta.json


def cross_entropy(train: np.ndarray, held_out: np.ndarray, vocab_size: int) -> float:
    """The mean of -log p(token) over `held_out`, p the smoothed frequencies of `train` over the vocabulary."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + SMOOTHING
    log_p = np.log(counts) - math.log(counts.sum())
    return float(-log_p[held_out].mean())


def of_splits(folder: Path, meta: dict) -> dict:
    """What meta.json keeps: the cross-entropy of the val split's tokens after the first (those the validation
    predicts) under the train split's frequencies, with the smoothing that made it."""
    train, val = (np.memmap(folder / meta["splits"][split]["file"], dtype=meta["dtype"], mode="r")
                  for split in ("train", "val"))
    return {"val": cross_entropy(np.asarray(train), np.asarray(val[1:]), meta["tokenizer"]["vocab_size"]),
            "smoothing": SMOOTHING}


def held_out_loss(folder: Path) -> float | None:
    """The prepared corpus' held-out unigram cross-entropy: meta.json's, else computed from its token files; None
    where the corpus is not there (moved, or a probe-only corpus without train and val splits)."""
    return kept_or_computed(folder, KEY, of_splits)


def kept_or_computed(folder: Path, key: str, of_splits) -> float | None:
    """A learning-check bar of a prepared corpus: meta.json's `key`, else `of_splits(folder, meta)` from its token
    files; None where the corpus or its splits are not there."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        return float(meta[key]["val"]) if key in meta else of_splits(folder, meta)["val"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
