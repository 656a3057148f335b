"""The largest of many sites against its own null. A report that scans the S norm sites of a model and names the
largest deviation of a mean angle to 1 from 90 must compare it with the largest of S such deviations under the null,
not with +-2 null sds: of 9 independent sites, one exceeds 2 about a third of the time. The null is the one angles.csv
already measured: the same mean angle to J random directions (null_random_means_deg), the same directions in every
run of a width d, so that the runs' average has a null of its own. With sites s, directions j and runs r:

- U(s): the runs' average of their mean angles to 1; M(s, j): the runs' average of their mean angles to direction j,
  what U(s) would be were 1 direction j. One run: its own mean angles.
- sigma(s): the sd over j of M(s, j), the null sd on the scale of U (for several runs it is that of their average,
  up to sqrt(runs) narrower than one run's); z(s) = (U(s) - 90) / sigma(s). The centre is 90 exactly: u and -u are
  equally likely directions, and their mean angles sum to 180.
- z_j(s) = (M(s, j) - 90) / sigma_-j(s), sigma_-j(s) from the other J - 1 directions: leave-one-out, so that a
  direction is no more part of its own null than 1 is (with itself in, a direction's |z| is capped at
  (J - 1)/sqrt(J) and shrunk, which would make p_max too small).
- T = max_s |z(s)|, T_j = max_s |z_j(s)|; p_max = (1 + #{j: T_j >= T}) / (1 + J): how often the largest of the S
  sites of a random direction is at least as far from 90. The maximum is taken per direction over the same sites, so
  the null keeps whatever dependence there is between sites. threshold: the |z| the largest site must exceed for
  p_max <= 0.05 (the floor(0.05 (J + 1))-th largest T_j; none for J < 19), which replaces +-2.
- The same on each run alone names the run and site that is most extreme: an outlier of one seed that the average
  hides. That run was chosen as the most extreme of R runs, so its p_max (that of one run) is set beside the p of the
  most extreme of R: 1 - (1 - p_max)^R (Šidák, for independent runs; at most R p_max whatever their dependence).
The signed mean angle cancels where seeds' 1-components point opposite ways; probe.shares holds its sign-invariant
twin, on the mean cos^2, which gathers its runs' values here (`measured`).
"""

import math
from dataclasses import dataclass

import numpy as np

from normlab.probe.profiles import last_step, null_means_by_site, site_key, site_sort, site_tick

LEVEL = 0.05
MIN_DIRECTIONS = 3  # a leave-one-out sd needs two other directions


class LargestOfSites:
    """A statistic per site (z) and the site of the largest |z|: what the signed and the sign-invariant extremes
    share."""

    @property
    def z_max(self) -> float:
        return self.z[self.site]

    @property
    def sites(self) -> int:
        return len(self.z)


@dataclass(frozen=True)
class SiteExtremes(LargestOfSites):
    """The deviations from 90 of one mean angle per site (a run's, or the runs' average) in null sds, and the largest
    of them against the largest of the same deviations of J random directions."""
    z: dict[tuple, float]  # per site (layer, role), in site order
    null_mean: dict[tuple, float]  # the mean over directions of their mean angles (90 up to sampling)
    null_sd: dict[tuple, float]  # sigma(s)
    site: tuple  # the site of the largest |z|
    p_max: float
    threshold: float | None  # the |z| the largest must exceed for p_max <= 0.05; None: too few directions
    directions: int


@dataclass(frozen=True)
class Extremes:
    """The largest of the sites for the runs' average (seed level) and for each run alone."""
    seed_level: SiteExtremes
    runs: list[tuple[str, SiteExtremes]]  # (label, that run's extremes), in the order given
    steps: set[int]

    @property
    def extreme_run(self) -> tuple[str, SiteExtremes]:
        """The run whose largest |z| is largest."""
        return max(self.runs, key=lambda item: abs(item[1].z_max))

    @property
    def extreme_run_p(self) -> float:
        """The p of the most extreme run for having been chosen among the runs (Šidák)."""
        return most_extreme_of(self.extreme_run[1].p_max, len(self.runs))


def most_extreme_of(p: float, count: int) -> float:
    """The p of the smallest of `count` independent p values, given that smallest: 1 - (1 - p)^count (Šidák)."""
    return 1 - (1 - p) ** count


@dataclass(frozen=True)
class Unavailable:
    """Why the largest-of-sites null cannot be computed for these runs (the caller falls back and says so)."""
    reason: str


def leave_one_out_sd(values: np.ndarray) -> np.ndarray:
    """[..., J] -> [..., J]: the sd over the last axis without entry j, for each j."""
    directions = values.shape[-1]
    # the sum of squares about the mean without direction j: SS - J/(J-1) (x_j - mean)^2
    centred = values - values.mean(axis=-1, keepdims=True)
    squares = (centred**2).sum(axis=-1, keepdims=True)
    return np.sqrt((squares - directions / (directions - 1) * centred**2) / (directions - 2))


def largest_against_null(largest: float, null_max: np.ndarray) -> tuple[float, float | None]:
    """(p_max, threshold) of 1's largest |z| over the sites against each direction's largest, null_max[j]."""
    directions = len(null_max)
    rank = math.floor(LEVEL * (directions + 1))
    return (float((1 + (null_max >= largest).sum()) / (1 + directions)),
            float(np.sort(null_max)[-rank]) if rank >= 1 else None)


def site_extremes(keys: list[tuple], targets: np.ndarray, null_means: np.ndarray) -> SiteExtremes:
    """keys: the S sites; targets[s]: the mean angle to 1 at site s, degrees; null_means[s, j]: to direction j."""
    sd = null_means.std(axis=1, ddof=1)
    z = (targets - 90) / sd
    null_max = np.abs((null_means - 90) / leave_one_out_sd(null_means)).max(axis=0)  # [J]
    p_max, threshold = largest_against_null(np.abs(z).max(), null_max)
    return SiteExtremes(
        z=dict(zip(keys, z.tolist())),
        null_mean=dict(zip(keys, null_means.mean(axis=1).tolist())),
        null_sd=dict(zip(keys, sd.tolist())),
        site=keys[int(np.abs(z).argmax())],
        p_max=p_max,
        threshold=threshold,
        directions=null_means.shape[1],
    )


@dataclass(frozen=True)
class Measured:
    """A value of 1 and the same for each random direction at every site of every run, checked comparable."""
    keys: list[tuple]  # the S sites, in site order
    targets: np.ndarray  # [runs, S]: 1's value
    null: np.ndarray  # [runs, S, J]: direction j's
    steps: set[int]


def measured(tables: list[list[dict]], labels: list[str], io: str = "input", reference: str = "uniform",
             step: int | None = None, target: str = "mean_deg",
             column: str = "null_random_means_deg") -> Measured | Unavailable:
    """The runs' `target` (the mean angle, or mean_cos2) of each site's input (or output) to `reference` over all
    positions at `step` (default: each run's last measured step), and the same for each random direction (`column`
    of the uniform row); Unavailable where a run lacks that column or the runs' directions differ."""
    if not tables:
        return Unavailable("no runs")
    found = []
    for rows, label in zip(tables, labels, strict=True):
        at = last_step(rows) if step is None else step
        targets = {site_key(r): r for r in rows if r["step"] == at and r["position"] == "all"
                   and r["reference"] == reference and r["site"].endswith(f".{io}")}
        if not targets:
            return Unavailable(f"{label} has no {io} angle to {reference} at step {at}")
        null = null_means_by_site(rows, at, io, column)
        if missing := sorted((k for k in targets if k not in null), key=site_sort):
            return Unavailable(f"{label} has no {column} at {len(missing)} of {len(targets)} sites "
                               f"(from {site_tick(missing[0])}; angles.csv written before the column, or "
                               "probe.null_directions=0): measure it again with normlab-angles")
        found.append((at, targets, null))
    keys = sorted(found[0][1], key=site_sort)
    if any(set(targets) != set(keys) for _, targets, _ in found):
        return Unavailable("the runs measured different norm sites")
    widths = sorted({r["d"] for _, targets, _ in found for r in targets.values()})
    if len(widths) > 1:
        return Unavailable(f"the runs have different widths d ({', '.join(map(str, widths))}): different directions")
    counts = sorted({len(values) for _, _, null in found for values in null.values()})
    if len(counts) > 1:
        return Unavailable(f"the runs have different numbers of random directions ({', '.join(map(str, counts))})")
    if counts[0] < MIN_DIRECTIONS:
        return Unavailable(f"{counts[0]} random directions: at least {MIN_DIRECTIONS} are needed")
    return Measured(keys, np.array([[t[k][target] for k in keys] for _, t, _ in found]),
                    np.array([[null[k] for k in keys] for _, _, null in found]), {at for at, _, _ in found})


def extremes(tables: list[list[dict]], labels: list[str], io: str = "input", reference: str = "uniform",
             step: int | None = None) -> Extremes | Unavailable:
    """The largest-of-sites statistic of the runs' angle rows (one table per run, `labels` naming them) for the
    mean angle of each site's input (or output) to `reference` over all positions, at `step` (default: each run's
    last measured step); Unavailable where a run lacks the per-direction means or the runs' nulls differ."""
    found = measured(tables, labels, io, reference, step)
    if isinstance(found, Unavailable):
        return found
    return Extremes(
        seed_level=site_extremes(found.keys, found.targets.mean(axis=0), found.null.mean(axis=0)),
        runs=[(label, site_extremes(found.keys, t, m)) for label, t, m in zip(labels, found.targets, found.null)],
        steps=found.steps,
    )
