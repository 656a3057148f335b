"""Angle profiles: the rows of one or more angles tables (one per run, or per pretrained model) reduced to one point
per norm site, averaged over the runs, with the null each mean angle is compared with; and how sites sort and are
named on an axis or in a table row. The report's tables and figures and training's per-layer figure read them."""

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

ROLE_ORDER = {"attn_norm": 0, "mlp_norm": 1, "final_norm": 2}
ROLE_TICKS = {"attn_norm": "attn", "mlp_norm": "MLP"}


def site_key(row: dict) -> tuple[int, str]:
    """(layer, role) of an angles or ablation row: (1, "mlp_norm"); the ablation of every norm at once: (-1, "all")."""
    if row["site"] == "all":
        return -1, "all"
    role = row.get("role") or row["site"].split(".")[0]
    return row.get("layer") if row.get("layer") is not None else -1, role


def site_sort(key: tuple[int, str]) -> tuple:
    layer, role = key
    return role == "all", layer, ROLE_ORDER.get(role, 3), role


def site_tick(key: tuple[int, str]) -> str:
    layer, role = key
    if role == "all":
        return "all"
    return "final" if role == "final_norm" else f"{layer} {ROLE_TICKS.get(role, role)}"


def last_step(rows: list[dict]) -> int | None:
    return max((r["step"] for r in rows), default=None)


@dataclass
class Point:
    """One norm site's angle to a reference, averaged over the runs (seeds) of a series."""
    steps: set[int]
    mean: float  # of the runs' mean angles
    seed_sd: float | None  # across runs (None for one)
    token_sd: float  # mean over the runs of the std over tokens
    share: float  # mean cos^2: the share of the squared norm along the reference
    d: int
    random_mean: float | None  # the null of a mean angle over random directions, where angles.csv measured it
    random_sd: float | None
    single_sd: float  # the null of one random vector's angle: (180/pi)/sqrt(d)
    iid_sd: float  # single_sd / sqrt(count): the null of a mean over independent tokens
    runs: int = 1
    # random_sd (or iid_sd) is on the scale of `mean`: one run, or the sd over directions of the runs-averaged
    # per-direction means (null_random_means_deg in every run). False: the mean of the runs' own sds, the scale of
    # one run, which is up to sqrt(runs) wider than that of their average (so deviation is understated)
    seed_level_null: bool = True

    @property
    def null_sd(self) -> float:
        return self.random_sd if self.random_sd is not None else self.iid_sd

    @property
    def deviation(self) -> float:
        """(mean - 90) in null standard deviations of a mean angle."""
        return (self.mean - 90) / self.null_sd if self.null_sd > 0 else math.inf


def mean_or_none(values: list) -> float | None:
    return None if any(v is None for v in values) else statistics.fmean(values)


def per_direction(row: dict, column: str = "null_random_means_deg") -> list[float] | None:
    """A row's values for each random direction (null_random_means_deg: mean angles, null_random_cos2: mean cos^2):
    a list as read back, text as AngleStats.records writes it; None where the row has none."""
    value = row.get(column)
    if isinstance(value, str):
        value = [float(c) for c in value.split()]
    return value or None


def null_means_by_site(rows: list[dict], step: int, io: str,
                       column: str = "null_random_means_deg") -> dict[tuple, list[float]]:
    """Per site, the mean angles (or, column null_random_cos2, the mean cos^2) of its input (or output) to each
    random direction at `step`, over all positions. They are stored on the uniform row alone: the same for every
    reference, the vectors being the same."""
    return {site_key(r): means for r in rows
            if r["step"] == step and r["position"] == "all" and r["reference"] == "uniform"
            and r["site"].endswith(f".{io}") and (means := per_direction(r, column))}


def seed_level_null(means: list[list[float] | None]) -> tuple[float, float] | None:
    """(mean, sd) over directions of the runs-averaged per-direction means: the null of a runs-averaged mean angle
    (the directions are the same in every run); None unless every run has them, as many of them, at least 2."""
    if any(m is None for m in means) or len({len(m) for m in means}) != 1 or len(means[0]) < 2:
        return None
    averaged = np.mean(means, axis=0)
    return float(averaged.mean()), float(averaged.std(ddof=1))


def profile(tables: list[list[dict]], io: str, reference: str, step: int | None = None) -> dict[tuple, Point]:
    """Per norm site (input or output), the runs' angle to `reference` over all positions at `step` (default:
    each run's last measured step), averaged over the runs that measured it. The null sd of several runs is that of
    their average where every run has the per-direction means (see Point.seed_level_null)."""
    by_site: dict[tuple, list[tuple[dict, list[float] | None]]] = defaultdict(list)
    for rows in tables:
        at = last_step(rows) if step is None else step
        null_means = null_means_by_site(rows, at, io)
        for row in rows:
            if (row["step"] == at and row["position"] == "all" and row["reference"] == reference
                    and row["site"].endswith(f".{io}")):
                by_site[site_key(row)].append((row, null_means.get(site_key(row))))
    points = {}
    for key, entries in by_site.items():
        rows = [row for row, _ in entries]
        means = [r["mean_deg"] for r in rows]
        seed_level = seed_level_null([m for _, m in entries]) if len(rows) > 1 else None
        random_mean, random_sd = seed_level or (mean_or_none([r.get("null_random_mean_deg") for r in rows]),
                                                mean_or_none([r.get("null_random_std_deg") for r in rows]))
        points[key] = Point(
            steps={r["step"] for r in rows},
            mean=statistics.fmean(means),
            seed_sd=statistics.stdev(means) if len(means) > 1 else None,
            token_sd=statistics.fmean(r["std_deg"] for r in rows),
            share=statistics.fmean(r["mean_cos2"] for r in rows),
            d=rows[0]["d"],
            random_mean=random_mean,
            random_sd=random_sd,
            single_sd=statistics.fmean(r["null_std_deg"] for r in rows),
            iid_sd=statistics.fmean(r["null_std_deg"] / math.sqrt(r["count"]) for r in rows),
            runs=len(rows),
            seed_level_null=len(rows) == 1 or seed_level is not None,
        )
    return dict(sorted(points.items(), key=lambda item: site_sort(item[0])))


def runs_text(count: int) -> str:
    return f"{count} run{'s' * (count != 1)}"


def step_text(profiles) -> str:
    """The steps the points of `profiles` were measured at: "0, 1,000"."""
    steps = sorted({s for p in profiles for point in p.values() for s in point.steps})
    return ", ".join(f"{s:,}" for s in steps)
