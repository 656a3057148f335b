"""The verdict as two compact tables of numbers: one row per comparison of the family (contrasts.family) and one row
per model and norm (its angles to 1, its share along 1, its ablation). Each row is a frozen dataclass built by a pure
function from the analysed runs; the column lists and captions below are the single source of how they are shown
(render.py writes them to markdown, CSV and wandb)."""

import statistics
from collections import defaultdict
from dataclasses import dataclass

from normlab.probe.extremes import Unavailable, extremes
from normlab.probe.profiles import last_step, profile, site_tick
from normlab.probe.shares import share_extremes
from normlab.study.report.contrasts import Contrast, sign_along_training
from normlab.study.report.groups import Group, Series, last_rows
from normlab.study.report.intervals import ALPHA, Interval
from normlab.study.report.pretrained import Pretrained
from normlab.study.report.render import Column, Table
from normlab.study.report.runs import along_1, null_rows

EFFECT_NAMES = {"centring": "centring (2x2)", "bias": "bias (2x2)", "interaction": "centring × bias"}


@dataclass(frozen=True)
class ComparisonRow:
    """One comparison of the family: its estimate, 95% and simultaneous intervals, Holm p, sign count and the
    smallest difference it would find after Holm with 80% power."""
    model: str
    comparison: str  # short: "centring (2x2)", "rmsnorm − layernorm_nobias"; ★ the declared primary
    label: str  # in full, as the tables below the verdict name it
    method: str
    seeds: int
    df: int | None
    mean: float
    ci_low: float | None
    ci_high: float | None
    sim_low: float | None
    sim_high: float | None
    p: float | None
    holm_p: float | None
    family_size: int
    above_0: int
    sign_test_p: float
    detectable_80: float | None
    per_seed: str  # each seed's difference, space-separated
    second_half: str  # the sign of the mean difference along the second half of training (loss_by_validation.csv)


def short_name(member: Contrast) -> str:
    """The comparison in a few characters: the factorial's effect, a branch group's role (control, restart; the
    caption and the CSV's label say what each measures), or `b − a`."""
    if member.effect:
        name = EFFECT_NAMES[member.effect]
    elif member.comparison is not None and member.comparison.role:
        name = member.comparison.role
    else:
        name = f"{member.comparison.other} − {member.comparison.base}" if member.comparison else member.label
    return name + (" ★" if member.primary else "")


def comparison_rows(members: list[Contrast]) -> tuple[ComparisonRow, ...]:
    rows = []
    for m in members:
        i: Interval = m.interval
        rows.append(ComparisonRow(m.group.title, short_name(m), m.label, m.method, i.n, i.df, i.mean, i.low, i.high,
                                  i.sim_low, i.sim_high, i.p, i.holm_p, i.family_size, m.above, m.sign_p,
                                  i.detectable, " ".join(f"{d:.9g}" for d in m.per_seed),
                                  sign_along_training(m.comparison) if m.comparison else ""))
    return tuple(rows)


COMPARISON_COLUMNS = (
    Column(("model",), "model", right=False), Column(("comparison",), "comparison", right=False),
    Column(("seeds",), "n"), Column(("mean",), "Δ", "+.4f"), Column(("ci_low", "ci_high"), "95% CI", "+.4f"),
    Column(("sim_low", "sim_high"), "simult. CI", "+.4f"), Column(("holm_p",), "p Holm", ".2g"),
    Column(("above_0",), ">0"), Column(("detectable_80",), "MDE", ".4f"),
)


def comparison_caption(rows: tuple[ComparisonRow, ...]) -> str:
    size = max((r.family_size for r in rows if r.holm_p is not None), default=0)
    return (
        "Δ: final validation loss as the comparison reads, b − a: b's minus a's (nats/token), mean over n seeds; "
        "for the 2x2's effects (centring and bias averaged over the other; centring × bias, the centring's effect "
        "with a bias − without) and its centring at each bias (its uncentred − centred pairs), a contrast of the "
        "cell means with the pooled residual of seed + cell, 3(n − 1) df; else a paired t, n − 1 df. Δ > 0: the "
        "uncentred (or the replacing) norm has the higher loss. Of branches "
        "(docs/branch.md): control, the zero-mean-writers control − the LN branch (float rounding alone); restart, "
        "the LN branch − its source continuing (what the restart costs). ★ the primary contrast, declared "
        "with the runs. 95% CI: each alone. simult. CI: all "
        f"{size} of the family together at 95%, matching Holm's test (in each direction at {ALPHA / 2:g}; "
        "Strassburger & Bretz 2008); an end at 0 says Holm rejected, no more. p Holm: adjusted over the family; a "
        f"comparison excludes 0 only where it is below {ALPHA:g}. >0: seeds whose difference is above 0 (of n; "
        "exact sign test p in verdict_comparisons.csv). MDE: the smallest true Δ these seeds, at this spread, find "
        f"after Holm with 80% power at least (a t test at {ALPHA:g}/{size or 1}, exact noncentral t). A CI that "
        "includes 0 says these seeds cannot tell, not that the norms are equal."
    )


def comparison_table(members: list[Contrast]) -> Table:
    rows = comparison_rows(members)
    return Table("verdict_comparisons", COMPARISON_COLUMNS, rows, comparison_caption(rows))


@dataclass(frozen=True)
class NormRow:
    """A norm of a model at the step of its loss: the signed angle statistic (the site farthest from 90°, in null
    sds, against the largest of all sites), the sign-invariant one on the mean cos² along 1, the largest share of
    ‖x‖² along 1 with its percentile among random directions' shares, and the ablation at every norm."""
    model: str
    norm: str
    runs: int
    step: int | None
    status: str  # "compared", "did not learn", "no better than bigrams", "pretrained"
    angle_z: float | None
    angle_p: float | None
    angle_site: str
    sites: int | None
    cos2_z: float | None
    cos2_p: float | None
    cos2_site: str
    share: float | None
    share_site: str
    share_percentile: float | None
    inverse_d: float | None
    ablation: str
    ablation_delta: float | None
    ablation_low: float | None
    ablation_high: float | None
    ablation_over: str  # what the interval resampled: "6 seeds (t)", "blocks of 4096 tokens (bootstrap)"
    ablation_null_pct: float | None  # its percentile among random directions' (AblationNull); None: no null run
    ablation_null_directions: int | None


def angle_numbers(series: Series) -> dict:
    points = profile(series.angles, "input", "uniform")
    if not points:
        return dict(angle_z=None, angle_p=None, angle_site="", sites=None, cos2_z=None, cos2_p=None, cos2_site="",
                    share=None, share_site="", share_percentile=None, inverse_d=None)
    found, shares = extremes(series.angles, series.labels), share_extremes(series.angles, series.labels)
    if isinstance(found, Unavailable):  # no null of the largest: the largest deviation in null sds, no p
        key, point = max(points.items(), key=lambda item: abs(item[1].deviation))
        angle = dict(angle_z=point.deviation, angle_p=None, angle_site=site_tick(key), sites=len(points))
    else:
        level = found.seed_level
        angle = dict(angle_z=level.z_max, angle_p=level.p_max, angle_site=site_tick(level.site), sites=level.sites)
    key, point = max(points.items(), key=lambda item: item[1].share)
    if isinstance(shares, Unavailable):
        cos2 = dict(cos2_z=None, cos2_p=None, cos2_site="", share_percentile=None)
    else:
        cos2 = dict(cos2_z=shares.z_max, cos2_p=shares.p_max, cos2_site=site_tick(shares.site),
                    share_percentile=shares.percentile[key])
    return {**angle, **cos2, "share": point.share, "share_site": site_tick(key), "inverse_d": 1 / point.d}


@dataclass(frozen=True)
class AblationNull:
    """Where the along-1 delta at every norm at once falls among the same ablation's deltas along random directions:
    one run's, or over seeds the mean delta among each direction's mean delta (the same directions in every run of a
    width: normlab-ablate's seed)."""
    percentile: float  # of the along-1 delta among the directions', percent (ties count half)
    directions: int
    median: float  # of the directions' deltas


def null_of(along_1: list[float], null: list[dict[str, float]]) -> AblationNull | None:
    """`along_1`: each run's delta; `null`: each run's deltas by direction. None where a run has no null."""
    shared = sorted(set.intersection(*(set(n) for n in null))) if null and all(null) else []
    if not shared:
        return None
    value = statistics.fmean(along_1)
    deltas = [statistics.fmean(n[k] for n in null) for k in shared]
    below = sum(d < value for d in deltas) + 0.5 * sum(d == value for d in deltas)
    return AblationNull(100 * below / len(deltas), len(deltas), statistics.median(deltas))


def ablation_found(series: Series) -> tuple[str, list[tuple[str, dict, dict[str, float]]]]:
    """The first ablation kind: per run (label) its row of every norm at once along 1, and its null's deltas by
    direction, at its newest step."""
    found = defaultdict(list)
    for label, rows in zip(series.labels, series.ablations):
        newest = last_rows(rows)
        for row in along_1(newest):
            if row["site"] == "all" and row.get("delta") is not None:
                kind = row.get("ablation") or ""
                found[kind].append((label, row, {r["direction"]: r["delta"] for r in null_rows(newest)
                                                 if (r.get("ablation") or "") == kind and r.get("delta") is not None}))
    return sorted(found.items())[0] if found else ("", [])


def ablation_numbers(series: Series) -> dict:
    """The first ablation kind's delta at every norm at once (site all): one run's with its bootstrap interval, or
    the mean over the runs with a t interval over them; and its percentile among the null's directions."""
    kind, found = ablation_found(series)
    if not found:
        return dict(ablation="not run", ablation_delta=None, ablation_low=None, ablation_high=None,
                    ablation_over="", ablation_null_pct=None, ablation_null_directions=None)
    null = null_of([row["delta"] for _, row, _ in found], [n for *_, n in found])
    nulls = dict(ablation_null_pct=null and null.percentile, ablation_null_directions=null and null.directions)
    if len(found) == 1:
        ((_, row, _),) = found
        unit = row.get("resampling_unit") or "windows"
        return dict(ablation=kind, ablation_delta=row["delta"], ablation_low=row.get("ci_low"),
                    ablation_high=row.get("ci_high"), ablation_over=f"{unit} (bootstrap)", **nulls)
    interval = Interval.of([row["delta"] for _, row, _ in found])
    return dict(ablation=kind, ablation_delta=interval.mean, ablation_low=interval.low,
                ablation_high=interval.high, ablation_over=f"{interval.n} seeds (t)", **nulls)


def norm_rows(groups: list[Group], pretrained: list[Pretrained]) -> tuple[NormRow, ...]:
    rows = []
    for group in groups:
        for arm in group.arms():
            runs, series = group.compared(arm), group.series_of(arm)
            if runs:
                step = max(r.val_step for r in runs)
                rows.append(NormRow(group.title, series.norm, len(runs), step, "compared", **angle_numbers(series),
                                    **ablation_numbers(series)))
            elif (every := [r for r in group.runs if r.norm == arm]) and all(r.learned is False for r in every):
                rows.append(NormRow(group.title, series.norm, 0, None, "did not learn", **angle_numbers(series),
                                    **{**ablation_numbers(series), "ablation": "not read"}))
            elif every and group.learning_check == "bigram" and all(r.beyond_bigrams is False for r in every):
                rows.append(NormRow(group.title, series.norm, 0, None, "no better than bigrams",
                                    **angle_numbers(series), **ablation_numbers(series)))
    for model in pretrained:
        (series,) = model.series()
        rows.append(NormRow(f"{model.name} (pretrained)", series.norm, 1, last_step(model.angles), "pretrained",
                            **angle_numbers(series), **ablation_numbers(series)))
    return tuple(rows)


NORM_COLUMNS = (
    Column(("model",), "model", right=False), Column(("norm",), "norm", right=False), Column(("runs",), "runs"),
    Column(("step",), "step", ","), Column(("angle_z",), "z∠", "+.1f"), Column(("angle_p",), "p", ".3f"),
    Column(("cos2_z",), "z cos²", "+.1f"), Column(("cos2_p",), "p", ".3f"), Column(("share",), "share 1", ".4f"),
    Column(("share_percentile",), "pct", ".0f"), Column(("ablation_delta",), "Δ abl.", "+.4f"),
    Column(("ablation_low", "ablation_high"), "95% CI", "+.4f"), Column(("ablation_null_pct",), "pct Δ", ".0f"),
)

NORM_CAPTION = (
    "At the norm inputs, at each norm's step; runs: the seeds compared (0: none passed the learning "
    "check, left out of every comparison). z∠: the mean angle to 1 at the site farthest from 90°, in "
    "sds of the same mean for random directions (a seed average against seed averages); p: the share "
    "of random directions whose own farthest site is as far, so the largest of all sites is accounted"
    " for (— : no null of the largest; see the notes). Seeds whose 1-components point opposite ways "
    "cancel in z∠. z cos²: each seed's mean cos² along 1 in sds of its own random directions', "
    "Stouffer over seeds, blind to the sign; − says 1 holds less of ‖x‖² than random directions do; p"
    " as for z∠. share 1: the largest share of ‖x‖² along 1 over the sites (1/d for a random "
    "direction on average); pct: its percentile among the random directions' shares at that site, not"
    " corrected for picking the site. Δ abl.: the change of loss when, at inference, every norm's "
    "centring is removed (LN) or added (RMS; for a layer that divides by no statistic, its inputs "
    "before its map); its 95% CI is a t over the seeds, or one run's bootstrap (verdict_norms.csv "
    "names the unit). pct Δ: where it falls among the same ablation's Δ along each random unit "
    "direction u in place of 1 (an RMS input loses its component along u; an LN's projection off 1 "
    "becomes the projection off u), over seeds the mean Δ among each direction's mean Δ; a high pct "
    "says 1 matters more than a random direction would (— : ablated without the null). In an LN model"
    " nothing reads the component along 1 before a norm removes it: the RMS rows are the informative "
    "ones."
)


def norm_table(groups: list[Group], pretrained: list[Pretrained]) -> Table:
    return Table("verdict_norms", NORM_COLUMNS, norm_rows(groups, pretrained), NORM_CAPTION)
