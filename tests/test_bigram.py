"""The report's bigram bar (data/bigram.py) on planted corpora whose answer is known in closed form: a Markov chain's
held-out cross-entropy under the fitted bigram model tends to the chain's entropy rate; on tokens drawn independently
the interpolation weight falls to the unigram's side and the bar is the unigram cross-entropy; a chain where each
token fixes the next scores nearly 0. The interpolation weight is chosen on the training split's end, never on the
held-out split."""

import numpy as np
import pytest

from normlab.data import bigram, unigram

VOCAB = 50257  # the GPT-2 vocabulary the real corpora have: most of it unseen here, as in a small corpus


def markov_chain(transitions: np.ndarray, length: int, seed: int) -> np.ndarray:
    """`length` states of the chain of row-stochastic `transitions`, started from state 0."""
    rng = np.random.default_rng(seed)
    cumulative = np.cumsum(transitions, axis=1)
    draws = rng.random(length)
    states = np.empty(length, dtype=np.int64)
    state = 0
    for i in range(length):
        states[i] = state = min(int(np.searchsorted(cumulative[state], draws[i], side="right")),
                                len(transitions) - 1)
    return states


def entropy_rate(transitions: np.ndarray) -> float:
    """-sum_a pi_a sum_b P(a, b) log P(a, b), pi the chain's stationary distribution."""
    values, vectors = np.linalg.eig(transitions.T)
    stationary = np.real(vectors[:, np.argmin(np.abs(values - 1))])
    stationary /= stationary.sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(transitions > 0, transitions * np.log(transitions), 0.0)
    return float(-(stationary[:, None] * terms).sum())


def test_a_markov_chains_bar_is_its_entropy_rate():
    rng = np.random.default_rng(0)
    transitions = rng.dirichlet(np.full(12, 0.5), size=12)  # 12 states, each row its own skewed distribution
    rate = entropy_rate(transitions)
    tokens = markov_chain(transitions, 400_000, seed=1) + 1000  # anywhere in the vocabulary
    train, held_out = tokens[:360_000], tokens[360_000:]
    found = bigram.fit_and_score(train, held_out, VOCAB)
    assert found["val"] == pytest.approx(rate, abs=0.01)  # 144 pairs seen ~2,500 times each: estimates close
    assert found["weight"] > 0.99  # every context seen often: the counts alone
    assert found["val"] < unigram.cross_entropy(train, held_out[1:], VOCAB) - 0.3  # the order matters here


def test_independent_tokens_give_their_entropy_and_a_weight_that_prefers_the_unigram():
    rng = np.random.default_rng(2)
    probabilities = rng.dirichlet(np.full(400, 0.3))
    entropy = float(-(probabilities * np.log(probabilities)).sum())
    tokens = rng.choice(400, size=200_000, p=probabilities)  # 160,000 possible pairs: most seen rarely or never
    found = bigram.fit_and_score(tokens[:150_000], tokens[150_000:], 400)
    assert found["weight"] < 0.5  # the pair counts are mostly noise: the unigram's side weighs more
    assert found["val"] == pytest.approx(entropy, abs=0.05)
    assert found["val"] > entropy - 0.02  # no better than the truth allows, up to sampling


def test_a_chain_where_each_token_fixes_the_next_scores_nearly_zero():
    cycle = np.tile(np.arange(7) * 3 + 5, 2000)
    found = bigram.fit_and_score(cycle[:12_000], cycle[12_000:], VOCAB)
    assert found["val"] < 0.01 and found["weight"] > 0.99


def test_the_weight_is_chosen_on_the_training_splits_end_not_on_the_held_out_split():
    rng = np.random.default_rng(3)
    train = rng.integers(0, 50, 20_000)
    chain = np.tile(np.arange(50), 200)  # held out: a deterministic chain the training text never showed
    found = bigram.fit_and_score(train, chain, VOCAB)
    cut = int(len(train) * (1 - bigram.TUNING_FRACTION))
    tuned = bigram.best_weight(*bigram.Bigrams(train[:cut], VOCAB).parts(train[cut:]))
    assert found["weight"] == pytest.approx(tuned)
    assert found["tuned_on"] == "the last 5% of the train split"
    fitted = bigram.Bigrams(train, VOCAB)
    scored = [fitted.cross_entropy(chain, w) for w in (found["weight"], 0.0, 1 - 1e-9)]
    assert scored[0] == pytest.approx(found["val"])
    assert min(scored) < scored[0]  # the held-out split would have chosen another weight: it was not asked


def test_the_weight_minimises_the_tuning_loss():
    rng = np.random.default_rng(4)
    tokens = markov_chain(rng.dirichlet(np.full(30, 0.2), size=30), 30_000, seed=5)
    model = bigram.Bigrams(tokens[:25_000], VOCAB)
    parts = model.parts(tokens[25_000:])
    best = bigram.best_weight(*parts)
    grid = np.linspace(0, 1, 2001)
    losses = [bigram.mean_loss(*parts, w) for w in grid]
    assert best == pytest.approx(grid[int(np.argmin(losses))], abs=1e-3)
    assert bigram.mean_loss(*parts, best) <= min(losses) + 1e-9
