"""The report's second bar: the held-out split's cross-entropy under a count bigram model of the training split
(nats/token), what a lookup table of which token follows which scores. A model whose blocks do any work beyond it
must score below it. The bigram probabilities are interpolated with the smoothed unigram's (Jelinek-Mercer), the
weight chosen on the last part of the training split (never on the validation split), then the counts refit on the
whole training split. normlab-prepare keeps it in meta.json; for a corpus prepared before it did, it is computed from
the token files (a few seconds on the embedded corpus, nothing written)."""

import math
from pathlib import Path

import numpy as np

from normlab.data import unigram

KEY = "bigram_cross_entropy"  # in meta.json
TUNING_FRACTION = 0.05  # the end of the training split on which the interpolation weight is chosen
FIT_TOKENS = 200_000_000  # at most this many training tokens counted (OpenWebText's 9B would need ~150 GB to sort):
                          # fewer counts only raise the bar's loss, so a larger corpus' bar is conservative
EVAL_TOKENS = 20_000_000  # at most this many held-out tokens scored


class Bigrams:
    """Counts of adjacent token pairs of one token array, with its smoothed unigram distribution."""

    def __init__(self, tokens: np.ndarray, vocab_size: int):
        tokens = np.asarray(tokens, dtype=np.int64)
        self.vocab_size = vocab_size
        self.pairs, self.pair_counts = np.unique(tokens[:-1] * vocab_size + tokens[1:], return_counts=True)
        self.context_counts = np.bincount(tokens[:-1], minlength=vocab_size)
        counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64) + unigram.SMOOTHING
        self.unigram = counts / counts.sum()

    def parts(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each token after the first: its bigram probability given the one before (0 for an unseen context),
        whether that context was seen, and its unigram probability."""
        tokens = np.asarray(tokens, dtype=np.int64)
        before, after = tokens[:-1], tokens[1:]
        codes = before * self.vocab_size + after
        at = np.minimum(np.searchsorted(self.pairs, codes), len(self.pairs) - 1)
        pair_count = np.where(self.pairs[at] == codes, self.pair_counts[at], 0)
        context = self.context_counts[before]
        seen = context > 0
        return pair_count / np.maximum(context, 1), seen, self.unigram[after]

    def cross_entropy(self, tokens: np.ndarray, weight: float) -> float:
        """The mean of -log p(token | the one before) over `tokens` after the first, p the bigram probability
        interpolated with the unigram's at `weight` (the unigram's alone after an unseen context)."""
        return mean_loss(*self.parts(tokens), weight)


def mean_loss(bigram: np.ndarray, seen: np.ndarray, unigram_p: np.ndarray, weight: float) -> float:
    p = np.where(seen, weight * bigram + (1 - weight) * unigram_p, unigram_p)
    with np.errstate(divide="ignore"):  # weight 1 and a pair never seen: an infinite loss, rightly
        return float(-np.log(p).mean())


def best_weight(bigram: np.ndarray, seen: np.ndarray, unigram_p: np.ndarray) -> float:
    """The interpolation weight in [0, 1] of least mean loss: the loss is convex in it (-log of a linear function),
    so a golden-section search finds it to 1e-6."""
    low, high = 0.0, 1.0
    ratio = (math.sqrt(5) - 1) / 2
    while high - low > 1e-6:
        a, b = high - ratio * (high - low), low + ratio * (high - low)
        if mean_loss(bigram, seen, unigram_p, a) <= mean_loss(bigram, seen, unigram_p, b):
            high = b
        else:
            low = a
    return (low + high) / 2


def fit_and_score(train: np.ndarray, held_out: np.ndarray, vocab_size: int) -> dict:
    """The weight chosen on the last TUNING_FRACTION of `train` (counts of the rest), then the counts of all of
    `train` scored on `held_out`: what meta.json keeps."""
    train = np.asarray(train[:FIT_TOKENS])
    cut = int(len(train) * (1 - TUNING_FRACTION))
    weight = best_weight(*Bigrams(train[:cut], vocab_size).parts(train[cut:]))
    loss = Bigrams(train, vocab_size).cross_entropy(np.asarray(held_out[:EVAL_TOKENS]), weight)
    return {"val": loss, "weight": weight, "tuned_on": f"the last {TUNING_FRACTION:.0%} of the train split",
            "train_tokens": int(len(train))}


def of_splits(folder: Path, meta: dict) -> dict:
    """What meta.json keeps, from the train and val token files of a prepared corpus."""
    train, val = (np.memmap(folder / meta["splits"][split]["file"], dtype=meta["dtype"], mode="r")
                  for split in ("train", "val"))
    return fit_and_score(train, val, meta["tokenizer"]["vocab_size"])


def held_out_loss(folder: Path) -> float | None:
    """The prepared corpus' held-out bigram cross-entropy: meta.json's, else computed from its token files; None
    where the corpus is not there (moved, or a probe-only corpus)."""
    return unigram.kept_or_computed(folder, KEY, of_splits)
