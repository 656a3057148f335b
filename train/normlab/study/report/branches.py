"""A group of branches (docs/branch.md) over the rest of training, from its step K on: each comparison's paired
difference of validation loss at every validation, with its t interval over the seeds (pointwise: at each step alone;
the final one is in the report's family), and each arm's share of ||x||^2 along 1 at the norm inputs at every
measured step, placed among random directions' shares with the sign-invariant largest-of-sites statistic
(probe.shares): does the uncentred branch grow a 1-component once nothing removes it, and how fast (it starts with
none, its stream centred by the conversion)?"""

import statistics
from dataclasses import dataclass

from normlab.probe.extremes import Unavailable
from normlab.probe.profiles import profile, site_tick
from normlab.probe.shares import share_extremes
from normlab.study.report.groups import Comparison, Group, Series
from normlab.study.report.intervals import Interval
from normlab.study.report.render import Column, Table, markdown, text_columns

POINTWISE = ("t 95% interval over the seeds at each step alone, not corrected for the steps; the final loss (the mean "
             "of the last validations) is the one in the report's family")


@dataclass(frozen=True)
class StepDifference:
    """A comparison's paired difference of validation loss at one step (optimizer steps done)."""
    step: int
    per_seed: list[float]

    @property
    def interval(self) -> Interval:
        return Interval.of(self.per_seed)


def differences_from_k(comparison: Comparison) -> list[StepDifference]:
    """At every validation step all of its runs logged (a branch logs from K on), the paired differences."""
    steps, differences = comparison.validation_differences()
    return [StepDifference(step, [pair[i] for pair in differences]) for i, step in enumerate(steps)]


@dataclass(frozen=True)
class StepShare:
    """An arm's share of ||x||^2 along 1 at the norm inputs at one measured step: over the sites and seeds, and
    at the site where it is largest, with where that share stands among random directions' shares there."""
    step: int
    runs: int
    mean_share: float  # the mean over the sites of the seeds' mean share
    site: tuple  # the site of the largest share
    largest: float
    percentile: float | None  # of `largest` among random directions' shares at that site (None: not measured)
    null_median: float | None  # the median random direction's share, averaged over the sites
    z: float | None  # the sign-invariant statistic's largest |Z| of the sites, signed
    p_max: float | None  # its p against the largest of random directions'

    def share_text(self) -> str:
        placed = f", percentile {self.percentile:.1f} among random directions'" if self.percentile is not None else ""
        return f"{self.largest:.4f} ({site_tick(self.site)}{placed})"

    def statistic_text(self) -> str:
        return "—" if self.z is None else f"{self.z:+.1f}, p {self.p_max:.3f}"


def shares_from_k(series: Series, k: int) -> list[StepShare]:
    """The arm's StepShare at every step its runs measured from K on."""
    found = []
    for step in sorted({r["step"] for rows in series.angles for r in rows if r["step"] >= k}):
        points = profile(series.angles, "input", "uniform", step)
        if not points:
            continue
        site, point = max(points.items(), key=lambda item: item[1].share)
        shares = share_extremes(series.angles, series.labels, step=step)
        measured = not isinstance(shares, Unavailable)
        found.append(StepShare(
            step, max(p.runs for p in points.values()), statistics.fmean(p.share for p in points.values()), site,
            point.share, shares.percentile.get(site) if measured else None,
            statistics.fmean(shares.null_median.values()) if measured else None,
            shares.z[shares.site] if measured else None, shares.p_max if measured else None))
    return found


def steps_text(steps: list[int], measured: list[int]) -> str:
    """'from step 800 on' where `steps` are every measured step from their first, else 'at steps 200, 600'."""
    if steps == [s for s in measured if s >= steps[0]]:
        return f"from step {steps[0]:,} on"
    return f"at step{'s' * (len(steps) > 1)} {', '.join(f'{s:,}' for s in steps)}"


def growth_text(found: list[StepShare]) -> str:
    """How an arm's share along 1 moved from K to the end, against a random direction's, and at which steps it lay
    beyond random directions' (p <= 0.05 for the largest of the sites), below them (a centred stream) or above."""
    first, last = found[0], found[-1]
    text = f"{first.mean_share:.4f} at step {first.step:,}, {last.mean_share:.4f} at step {last.step:,}"
    if last.null_median is not None:
        text += f" (a random direction's median share: {last.null_median:.4f})"
    if any(s.p_max is None for s in found):
        return text + "; not measured against random directions"
    measured = [s.step for s in found]
    beyond = {side: [s.step for s in found if s.p_max <= 0.05 and (s.z > 0) == (side == "above")]
              for side in ("below", "above")}
    parts = [f"its most extreme site {side} random directions' {steps_text(steps, measured)}"
             for side, steps in beyond.items() if steps]
    return text + "; " + ("; ".join(parts) if parts else "never beyond random directions'")


def difference_table(group: Group) -> str:
    """Per validation step from K, each comparison's mean paired difference and its pointwise interval."""
    found = [(c, {d.step: d for d in differences_from_k(c)}) for c in group.comparisons]
    steps = sorted({s for _, by_step in found for s in by_step})
    if not steps:
        return ""
    columns = (Column((0,), "step"), *(Column((i,), f"{c.other} − {c.base}", right=False)
                                        for i, (c, _) in enumerate(found, 1)))
    rows = [{0: f"{step:,}", **{i: by_step[step].interval.text() if step in by_step else "—"
                                for i, (_, by_step) in enumerate(found, 1)}} for step in steps]
    return (markdown(Table("branch_differences", columns, tuple(rows)))
            + f"\nMean paired difference of validation loss (nats/token) [{POINTWISE}].\n")


def share_table(group: Group) -> str:
    """Per arm and measured step from K, its share along 1 at the norm inputs (StepShare), and how it moved
    (growth_text)."""
    k = group.branch_step or 0
    columns = text_columns("arm", "step", "runs", "share along 1, mean over the norm inputs", "largest share (site)",
                           "random direction's median share", "sign-invariant largest-of-sites Z, p",
                           right=(1, 2, 3, 5))
    rows, summary = [], []
    for series in group.series():
        found = shares_from_k(series, k)
        for s in found:
            median = "—" if s.null_median is None else f"{s.null_median:.4f}"
            rows.append(dict(zip((c.keys[0] for c in columns), (
                series.norm, f"{s.step:,}", s.runs, f"{s.mean_share:.4f}", s.share_text(), median,
                s.statistic_text()))))
        if found:
            summary.append(f"- {series.norm}: {growth_text(found)}.")
    if not summary:
        return ""
    return (markdown(Table("branch_shares", columns, tuple(rows)))
            + "\nShares are seed means (the probe's held-out tokens at each checkpoint); Z and p: "
            "each seed's mean cos² along 1 against its own random directions, combined over the seeds, the largest "
            "of the sites against the largest of each random direction's (docs/report.md). Each arm's share, mean "
            "over the norm inputs, at K and at the end, and the steps where its most extreme site lay beyond random "
            "directions' (p ≤ 0.05 for the largest of the sites): below them (Z < 0: a centred stream holds none) "
            "or above them (a 1-component grown); a site that grew above them while another stays centred shows "
            "in the largest share's percentile:\n\n"
            + "\n".join(summary) + "\n")


def branch_section(group: Group) -> list[str]:
    """summary.md's branch subsections of a group of branches ([] for any other group)."""
    if group.branch_step is None:
        return []
    text = []
    if table := difference_table(group):
        text += [f"### From step {group.branch_step:,}: paired difference of validation loss at every validation\n",
                 table]
    if table := share_table(group):
        text += [f"### From step {group.branch_step:,}: the share of ‖x‖² along 1 at the norm inputs\n", table]
    return text
