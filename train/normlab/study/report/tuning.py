"""A tuning sweep's answer (normlab-report tuning=optimizer.lr): the runs grouped by their comparison settings less
the setting swept; in each group, every norm's final validation loss at each value of the setting (the mean over its
seeds there), its best value, and whether that best lies inside the grid or at one of its ends (then the grid is
extended before the study: a best at an end is a bound, not a choice). A run that diverged (a final loss that is not
finite) counts as worse than any other value; one unfinished is left out of its value. Where the centring x bias 2x2
was swept, the centring's effect at each value and its change from one value to the next, paired by seed, with a t
interval over the seeds where there are several (the study's seeds at several rates: its dependence on the rate)."""

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass

from normlab.study.report.groups import arm_label, arms_of, comparison_settings, settings_key
from normlab.study.report.intervals import Interval
from normlab.study.report.render import Column, Table
from normlab.training.rundir.config import flat

INSIDE, LOWEST, HIGHEST, NONE = "inside", "lowest", "highest", "none"  # where a norm's best lies in its grid


@dataclass(frozen=True)
class Point:
    """One norm at one value of the setting swept: its runs' mean final loss (inf where one diverged)."""
    group: str
    norm: str
    value: float
    runs: tuple[str, ...]
    seeds: tuple[int, ...]
    final_val_loss: float
    seed_sd: float | None  # the sd of the final loss over its seeds (None: one seed)
    above_best: float | None = None  # its loss minus its norm's best (0 at the best), over `ranked_seeds`
    ranked_seeds: tuple[int, ...] = ()  # the seeds every value of its norm has (its own where they share none)
    best: bool = False
    cell: tuple[bool, bool] | None = None  # (centres, bias) for a norm of the centring x bias 2x2 (its traits)
    losses: tuple[float, ...] = ()  # each run's final loss, in the order of `seeds` (inf: it diverged)


@dataclass(frozen=True)
class Choice:
    """A norm's best value of the setting in its grid, where it lies in the grid, and its neighbours' distance."""
    group: str
    norm: str
    best: float
    final_val_loss: float
    grid: tuple[float, ...]
    where: str  # INSIDE, LOWEST or HIGHEST; NONE: every value diverged
    next_above: float | None  # the smaller of its grid neighbours' loss above its own (inf: a neighbour diverged)
    bigram_margin: float | None  # the best's final loss below its data's bigram bar (negative: above it)

    @property
    def inside(self) -> bool:
        return self.where == INSIDE

    @property
    def advice(self) -> str:
        if self.where == INSIDE:
            return "inside the grid"
        if self.where == NONE:
            return "every value diverged: sweep lower values"
        if len(self.grid) == 1:
            return "one value: sweep a grid around it"
        side, end = ("below", self.grid[0]) if self.where == LOWEST else ("above", self.grid[-1])
        return f"at the grid's {self.where}: extend it {side} {end:g}"


@dataclass(frozen=True)
class CentringAt:
    """The centring's effect at one value of the setting: uncentred − centred final loss with a bias, without, or the
    two averaged (the 2x2's main effect), paired by seed: the mean over the seeds that every norm it needs has at
    that value, and its 95% t interval over them (None under 2 seeds)."""
    group: str
    value: float
    bias: str  # "with", "without" or "averaged"
    difference: float
    seeds: tuple[int, ...] = ()
    low: float | None = None
    high: float | None = None
    by_seed: tuple[float, ...] = ()  # the differences, in the order of `seeds`


@dataclass(frozen=True)
class CentringChange:
    """How the centring's effect (one bias setting) changes from one value of the setting to the next value where
    it is known: per seed, its effect at `higher` minus at `lower`; the mean over the seeds known at both, and its 95%
    t interval over them (None under 2 seeds)."""
    group: str
    bias: str
    lower: float
    higher: float
    change: float
    seeds: tuple[int, ...]
    low: float | None
    high: float | None


def paired(title: str, value: float, bias: str, by_seed: dict[int, float]) -> CentringAt:
    seeds = tuple(sorted(by_seed))
    differences = [by_seed[seed] for seed in seeds]
    interval = Interval.of(differences)
    return CentringAt(title, value, bias, interval.mean, seeds, interval.low, interval.high, tuple(differences))


@dataclass(frozen=True)
class Tuning:
    """The points and choices of one group of runs that differ only in the norm, the seed and the setting swept."""
    title: str
    key: str
    points: tuple[Point, ...]
    choices: tuple[Choice, ...]
    left_out: tuple[tuple[str, str], ...]  # (run, why)
    bigram_loss: float | None  # the held-out cross-entropy of a count bigram model of the group's data, if known

    def centring(self) -> list[CentringAt]:
        """At each value where both norms of a bias setting of the 2x2 have a finite loss and a seed in common,
        uncentred − centred, paired by seed; averaged over bias over the seeds all four norms have there."""
        found = []
        for value in sorted({p.value for p in self.points}):
            cells = {p.cell: dict(zip(p.seeds, p.losses)) for p in self.points
                     if p.value == value and p.cell and math.isfinite(p.final_val_loss)}
            effects = {}
            for bias in (True, False):
                if (False, bias) in cells and (True, bias) in cells:
                    uncentred, centred = cells[(False, bias)], cells[(True, bias)]
                    effects[bias] = {s: uncentred[s] - centred[s] for s in uncentred.keys() & centred.keys()}
            effects = {bias: by_seed for bias, by_seed in effects.items() if by_seed}
            found += [paired(self.title, value, "with" if bias else "without", by_seed)
                      for bias, by_seed in effects.items()]
            if len(effects) == 2 and (both := effects[True].keys() & effects[False].keys()):
                found.append(paired(self.title, value, "averaged",
                                    {s: (effects[True][s] + effects[False][s]) / 2 for s in both}))
        return found

    def centring_changes(self) -> list[CentringChange]:
        """For each bias setting, from each value where the centring's effect is known to the next one, over the
        seeds known at both."""
        changes, centring = [], self.centring()
        for bias in ("with", "without", "averaged"):
            along = [c for c in centring if c.bias == bias]
            for lower, higher in zip(along, along[1:]):
                at_lower, at_higher = dict(zip(lower.seeds, lower.by_seed)), dict(zip(higher.seeds, higher.by_seed))
                seeds = tuple(sorted(at_lower.keys() & at_higher.keys()))
                if seeds:
                    interval = Interval.of([at_higher[s] - at_lower[s] for s in seeds])
                    changes.append(CentringChange(self.title, bias, lower.value, higher.value, interval.mean, seeds,
                                                  interval.low, interval.high))
        return changes


def value_of(config: dict, key: str) -> float | None:
    value = flat(config).get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def tune(runs: list, key: str) -> list[Tuning]:
    """The tuning of `key` in `runs` (runs.Run), one Tuning per group of equal settings but for `key`."""
    groups: dict[str, list] = defaultdict(list)
    for run in runs:
        settings = {k: v for k, v in comparison_settings(run.config).items() if k != key}
        groups[settings_key(settings)].append(run)
    titled = sorted(groups.values(), key=lambda members: (members[0].model, members[0].name))
    return [tuning_of(f"{members[0].model} (group {i + 1} of {len(titled)})" if len(titled) > 1 else members[0].model,
                      members, key) for i, members in enumerate(titled)]


def tuning_of(title: str, runs: list, key: str) -> Tuning:
    by_arm: dict = defaultdict(lambda: defaultdict(list))  # a norm (runs.Arm) -> value -> its runs there
    left_out = []
    for run in sorted(runs, key=lambda r: (r.norm.order, r.name)):
        value = value_of(run.config, key)
        if value is None:
            left_out.append((run.name, f"{key} is not a number in its config.yaml"))
        elif run.incomplete and not run.diverged:
            left_out.append((run.name, run.incomplete))
        else:
            by_arm[run.norm][value].append(run)
    points, choices = [], []
    arms = arms_of(runs)
    bigram_loss = next((r.bigram_loss for r in runs if r.bigram_loss is not None), None)  # the group's data's
    for arm in sorted(by_arm, key=lambda a: a.order):
        norm, by_value = arm_label(arms, arm), by_arm[arm]
        mine = [point(title, norm, value, found) for value, found in sorted(by_value.items())]
        shared = set.intersection(*(set(p.seeds) for p in mine))  # values are ranked on the same seeds
        ranked = [ranked_loss(p, shared) for p in mine]
        best = min(ranked)
        finite = math.isfinite(best)  # else every value diverged: no best
        at = ranked.index(best)
        cell = (arm.traits.centres, arm.traits.bias) if arm.traits.centring_pair else None
        mine = [Point(**{**vars(p), "above_best": loss - best if finite else None, "best": i == at and finite,
                         "cell": cell, "ranked_seeds": tuple(sorted(shared)) if shared else p.seeds})
                for i, (p, loss) in enumerate(zip(mine, ranked))]
        points += mine
        choices.append(choice(title, norm, mine, bigram_loss))
    return Tuning(title, key, tuple(points), tuple(choices), tuple(left_out), bigram_loss)


def point(title: str, norm: str, value: float, runs: list) -> Point:
    losses = [math.inf if r.diverged or not math.isfinite(r.final_val_loss) else r.final_val_loss for r in runs]
    finite = [v for v in losses if math.isfinite(v)]
    return Point(title, norm, value, tuple(r.name for r in runs), tuple(r.seed for r in runs),
                 math.fsum(losses) / len(losses) if len(finite) == len(losses) else math.inf,
                 statistics.stdev(finite) if len(finite) > 1 and len(finite) == len(losses) else None,
                 losses=tuple(losses))


def ranked_loss(point: Point, shared: set[int]) -> float:
    """A value's loss as its norm's values are ranked: the mean over the seeds they all have (a value with seeds the
    others lack would otherwise be ranked on other seeds than its neighbours); over its own where they share none."""
    losses = [loss for seed, loss in zip(point.seeds, point.losses) if seed in shared] if shared else point.losses
    return math.fsum(losses) / len(losses) if all(map(math.isfinite, losses)) else math.inf


def choice(title: str, norm: str, points: list[Point], bigram_loss: float | None) -> Choice:
    grid = tuple(p.value for p in points)
    at = next((i for i, p in enumerate(points) if p.best), None)
    if at is None:
        return Choice(title, norm, math.nan, math.inf, grid, NONE, None, None)
    where = LOWEST if at == 0 else HIGHEST if at == len(points) - 1 else INSIDE
    neighbours = [points[i].above_best for i in (at - 1, at + 1) if 0 <= i < len(points)]
    best = points[at]
    margin = bigram_loss - best.final_val_loss if bigram_loss is not None else None  # the best is finite here
    return Choice(title, norm, best.value, best.final_val_loss, grid, where, min(neighbours) if neighbours else None,
                  margin)


ABOVE_BEST = Column(("above_best",), "Δ best", "+.4f")  # its cell in markdown carries a † (points_table)


def points_table(tunings: list[Tuning]) -> Table:
    key = tunings[0].key if tunings else "setting"
    columns = (Column(("group",), "group", right=False), Column(("norm",), "norm", right=False),
               Column(("value",), key, "g"), Column(("final_val_loss",), "final loss", ".4f"),
               Column(("above_best_text",), ABOVE_BEST.title), Column(("seed_sd",), "sd seeds", ".4f"),
               Column(("seeds",), "seeds", right=False))
    caption = (f"Each norm's final validation loss (nats/token, the mean of its last validations as its config "
               f"declares, and over its seeds at that {key}) at each value swept; Δ best: above that norm's lowest, "
               "both over the seeds every value of the norm has (†: fewer than this value's, ranked_seeds in the "
               "CSV), the best the lowest so compared; "
               "sd seeds: over its seeds where there are several. inf: a run diverged (its loss not finite). With "
               "one seed a value, a difference between neighbouring values smaller than the seed-to-seed spread does "
               "not rank them: the best is a choice among them, not an estimate of the optimum.")
    rows = tuple({**vars(p), "seeds": " ".join(map(str, p.seeds)), "ranked_seeds": " ".join(map(str, p.ranked_seeds)),
                  "above_best_text": ABOVE_BEST.number(p.above_best)
                  + ("†" if p.above_best is not None and set(p.ranked_seeds) != set(p.seeds) else "")}
                 for t in tunings for p in t.points)
    return Table("tuning", columns, rows, caption)


def choices_table(tunings: list[Tuning]) -> Table:
    key = tunings[0].key if tunings else "setting"
    columns = (Column(("group",), "group", right=False), Column(("norm",), "norm", right=False),
               Column(("best",), f"best {key}", "g"), Column(("final_val_loss",), "final loss", ".4f"),
               Column(("next_above",), "next Δ", "+.4f"), Column(("bigram_margin",), "below bigram", "+.4f"),
               Column(("advice",), "grid", right=False))
    caption = (f"Each norm's {key} of lowest final loss in its grid, its values compared over the seeds they all "
               "have (the table below); final loss: over the best's own seeds; next Δ: the nearer of its grid "
               "neighbours' loss above it (small: a flat optimum); below bigram: its final loss below the count "
               "bigram model's held-out cross-entropy of its data (negative: above it, the model no better than a "
               "lookup table). A best at an end of the grid is a bound: the grid is extended there before the study "
               "uses it.")
    rows = tuple({**vars(c), "grid": " ".join(f"{v:g}" for v in c.grid), "advice": c.advice}
                 for t in tunings for c in t.choices)
    return Table("tuning_choices", columns, rows, caption)


def centring_table(tunings: list[Tuning]) -> Table:
    key = tunings[0].key if tunings else "setting"
    columns = (Column(("group",), "group", right=False), Column(("value",), key, "g"),
               Column(("bias",), "bias", right=False), Column(("difference",), "uncentred − centred", "+.4f"),
               Column(("low", "high"), "95% CI", "+.4f"), Column(("n",), "n"))
    caption = (f"The centring's effect at each {key}: the uncentred norm's final loss minus the centred one's with the "
               "same bias (nats/token), and the two averaged; paired by seed, the mean over the n seeds that the "
               "norms share there, with a 95% t interval over them (each row alone: the rows are not a family, and "
               "nothing here is corrected for their number). With one seed a value (a tuning's grid) no interval: "
               "descriptive, a hint of a dependence on the rate that seeds at each rate estimate.")
    rows = tuple({**vars(c), "n": len(c.seeds), "seeds": " ".join(map(str, c.seeds)),
                  "by_seed": " ".join(f"{d:.6f}" for d in c.by_seed)} for t in tunings for c in t.centring())
    return Table("tuning_centring", columns, rows, caption)


def centring_change_table(tunings: list[Tuning]) -> Table:
    key = tunings[0].key if tunings else "setting"
    columns = (Column(("group",), "group", right=False), Column(("bias",), "bias", right=False),
               Column(("lower",), "from", "g"), Column(("higher",), "to", "g"),
               Column(("change",), "Δ centring", "+.4f"), Column(("low", "high"), "95% CI", "+.4f"),
               Column(("n",), "n"))
    caption = (f"How the centring's effect changes along {key}: per seed, its effect (the table above) at the higher "
               "value minus at the lower one, the mean over the n seeds known at both, with a 95% t interval over "
               "them (each row alone, uncorrected). An interval that excludes 0 says the centring's effect depends "
               "on the rate between these two values; one that includes it says these seeds cannot tell.")
    rows = tuple({**vars(c), "n": len(c.seeds), "seeds": " ".join(map(str, c.seeds))}
                 for t in tunings for c in t.centring_changes())
    return Table("tuning_centring_change", columns, rows, caption)
