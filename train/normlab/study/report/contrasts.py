"""The verdict's comparisons as one family: the centring x bias 2x2 analysed as a factorial blocked by seed, each
comparison's interval beside its Holm-adjusted twin, the exact sign test of its seeds, the smallest difference it could
detect, and the sign of its paired difference along the second half of training.

The 2x2 (four norms, each seed a block of four runs that share initial weights and batches): loss y(c, s) of cell c
and seed s = seed effect + cell effect + noise. Over the seeds every cell has (n of them), the residual of the
additive model, y - cell mean - seed mean + grand mean, gives one pooled variance on 3(n - 1) degrees of freedom (15
for 6 seeds, where a paired t of one pair of cells has n - 1 = 5); every effect is a contrast of the cell means, with
standard error sd x sqrt(sum of its weights² / n). Effects are uncentred − centred and with − without: > 0 says
the centring lowers the loss, or the bias raises it."""

import math
import statistics
from dataclasses import dataclass, replace

from normlab.study.report.groups import Comparison, Group
from normlab.study.report.intervals import Interval, sign_test_p, simultaneous

# The factorial's effects by cell (centres, bias): its weights on the four cell means
EFFECTS = {
    "centring": {(False, True): 0.5, (True, True): -0.5, (False, False): 0.5, (True, False): -0.5},
    "bias": {(True, True): 0.5, (True, False): -0.5, (False, True): 0.5, (False, False): -0.5},
    "interaction": {(False, True): 1.0, (True, True): -1.0, (False, False): -1.0, (True, False): 1.0},
}
EFFECT_LABELS = {"centring": "centring, averaged over bias (uncentred − centred)",
                 "bias": "bias, averaged over centring (with − without)",
                 "interaction": "interaction (the centring's effect with a bias − without)"}


@dataclass(frozen=True)
class Contrast:
    """One comparison of the family: what it estimates, per seed (the sign test's input) and its interval."""
    label: str
    group: Group
    per_seed: list[float]
    interval: Interval
    method: str  # "paired t" or "2x2 factorial blocked by seed, pooled residual"
    effect: str = ""  # the factorial's effect (EFFECTS), or "" for a paired comparison
    comparison: Comparison | None = None
    primary: bool = False

    @property
    def above(self) -> int:
        return sum(d > 0 for d in self.per_seed)

    @property
    def sign_p(self) -> float:
        return sign_test_p(self.above, len(self.per_seed))

    def sign_text(self) -> str:
        return f"above 0 in {self.above} of {len(self.per_seed)} seeds (sign test p {self.sign_p:.3g})"


def complete_blocks(group: Group) -> dict[tuple, dict[tuple[bool, bool], float]] | None:
    """seed (pairing) -> cell -> final loss, for the seeds with a compared run in all four cells of the 2x2; None
    where the group's 2x2 is incomplete."""
    if len(group.cells) < 4:
        return None
    runs = {cell: {r.pairing: r for r in group.compared(arm)} for cell, arm in group.cells.items()}
    seeds = sorted(set.intersection(*(set(found) for found in runs.values())))
    return {s: {cell: runs[cell][s].final_val_loss for cell in runs} for s in seeds} or None


def factorial(group: Group) -> dict[str, Contrast]:
    """The 2x2's effects (EFFECTS) and its two simple centring effects (with and without bias), each with the
    pooled residual variance; {} where the 2x2 is incomplete or has fewer than 2 complete seeds."""
    blocks = complete_blocks(group)
    if not blocks or len(blocks) < 2:
        return {}
    n, cells = len(blocks), list(EFFECTS["centring"])
    cell_mean = {c: statistics.fmean(b[c] for b in blocks.values()) for c in cells}
    seed_mean = {s: statistics.fmean(b.values()) for s, b in blocks.items()}
    grand = statistics.fmean(cell_mean.values())
    residual = math.fsum((b[c] - cell_mean[c] - seed_mean[s] + grand) ** 2 for s, b in blocks.items() for c in cells)
    df = 3 * (n - 1)
    sd = math.sqrt(residual / df)

    def contrast(weights: dict, label: str, effect: str) -> Contrast:
        per_seed = [math.fsum(w * b[c] for c, w in weights.items()) for b in blocks.values()]
        se = sd * math.sqrt(sum(w * w for w in weights.values()) / n)
        interval = Interval.with_se(n, statistics.fmean(per_seed), sd, se, df)
        return Contrast(label, group, per_seed, interval, "2x2 factorial blocked by seed, pooled residual", effect)

    found = {name: contrast(weights, EFFECT_LABELS[name], name) for name, weights in EFFECTS.items()}
    for bias in (True, False):
        weights = {(False, bias): 1.0, (True, bias): -1.0}
        found[f"centring {'with' if bias else 'without'} bias"] = contrast(weights, "", "")
    return found


def group_family(group: Group, primary: str | None) -> list[Contrast]:
    """The group's comparisons: the factorial's effects (where its 2x2 is complete) and every declared pair, a
    simple centring effect of the 2x2 with the factorial's pooled variance, any other by a paired t. In a group of
    branches the primary centring contrast is its uncentred − centred pair (the 2x2's bias is not varied there)."""
    effects = factorial(group)
    family = [replace(c, primary=name == primary) for name, c in effects.items() if name in EFFECTS]
    branch_primary = group.branch_step is not None and primary == "centring"  # a branch group: uncentred − centred
    for comparison in group.comparisons:
        simple = effects.get(f"centring {'with' if comparison.bias else 'without'} bias") if (
            comparison.centring and comparison.bias is not None) else None
        if simple is not None:
            family.append(replace(simple, label=comparison.label, comparison=comparison))
        else:
            family.append(Contrast(comparison.label, group, comparison.differences, comparison.interval, "paired t",
                                   comparison=comparison, primary=branch_primary and comparison.centring))
    return family


def primary_of(group: Group) -> str | None:
    """analysis.primary, as the group's runs declare it (the first run's, where they disagree)."""
    declared = [(r.config.get("analysis") or {}).get("primary", "centring") for r in group.runs]
    return declared[0] if declared else None


def family(groups: list[Group]) -> list[Contrast]:
    """Every comparison of the verdict, with its simultaneous interval and Holm p over the family (the pooled interval
    for a simple effect of a complete 2x2): every table and figure shows the member's."""
    members = [c for g in groups for c in group_family(g, primary_of(g))]
    adjusted = simultaneous([c.interval for c in members])
    return [replace(member, interval=interval) for member, interval in zip(members, adjusted)]


def intervals_of(members: list[Contrast], group: Group) -> dict[str, Interval]:
    """The family's interval of each of the group's comparisons, by its label."""
    return {m.comparison.label: m.interval for m in members if m.comparison is not None and m.group is group}


def sign_along_training(comparison: Comparison) -> str:
    """The mean paired difference of validation loss at each validation step of the second half of training: the
    steps where its sign changed, and whether it held over the last quarter."""
    steps, differences = comparison.validation_differences()
    final = max((r.max_steps or 0 for pair in comparison.pairs for r in pair), default=0) or (steps or [0])[-1]
    second = [(s, statistics.fmean(d)) for s, *d in zip(steps, *differences) if s > final / 2]
    if len(second) < 2:
        return "too few validations in the second half to follow its sign"
    changes = [s for (_, a), (s, b) in zip(second, second[1:]) if (a > 0) != (b > 0)]
    last_quarter = [m for s, m in second if s > 3 * final / 4]
    held = len({m > 0 for m in last_quarter}) == 1
    sign = "> 0" if last_quarter and last_quarter[-1] > 0 else "< 0"
    changed = (f"changed sign at step{'s' * (len(changes) > 1)} {', '.join(f'{s:,}' for s in changes)}"
               if changes else "kept one sign")
    return (f"mean over seeds, steps {second[0][0]:,}-{second[-1][0]:,}: {changed}; "
            + (f"{sign} at every validation of the last quarter" if held else "both signs in the last quarter"))
