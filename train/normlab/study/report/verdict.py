"""The verdict: one row per model and norm (the paired loss difference, the largest deviation of a mean angle to 1
from the null, the largest share along 1 and the ablation at every norm), its footnotes and how to read it."""

import statistics
from collections import defaultdict

from normlab.probe.profiles import last_step, profile, runs_text, site_tick
from normlab.study.report.groups import Group, Series, last_rows
from normlab.study.report.intervals import Interval
from normlab.study.report.pretrained import Pretrained

DEMO_MODELS = ("tiny",)
DEMO_NOTE = "demo scale: not evidence about the paper's models"


def ablation_cell(series: Series, command: str) -> str:
    values = defaultdict(list)  # per ablation kind: (delta, low, high) per run
    for rows in series.ablations:
        for row in last_rows(rows):
            if row["site"] == "all" and row.get("delta") is not None:
                values[row.get("ablation") or ""].append((row["delta"], row.get("ci_low"), row.get("ci_high")))
    if not values:
        return f"not run ({command})"
    cells = []
    for kind, runs in sorted(values.items()):
        prefix = f"{kind}: " if kind else ""
        if len(runs) == 1:
            delta, low, high = runs[0]
            ci = f" [{low:+.4f}, {high:+.4f}]" if low is not None and high is not None else ""
            cells.append(f"{prefix}{delta:+.4f}{ci}")
        else:
            deltas = [r[0] for r in runs]
            cells.append(f"{prefix}{statistics.fmean(deltas):+.4f} (mean of {len(deltas)} seeds, "
                         f"{min(deltas):+.4f}..{max(deltas):+.4f})")
    missing = sum(1 for rows in series.ablations if not rows)
    return "; ".join(cells) + (f"; {runs_text(missing)} not ablated" if missing > 0 else "")


def angle_cells(series: Series) -> tuple[str, str, bool]:
    """(largest deviation of a layer's mean angle from 90 in null sds, largest share along 1, whether the null sd
    is the one measured over random directions) at the norm inputs."""
    points = profile(series.angles, "input", "uniform")
    if not points:
        return "no angles.csv", "—", True
    key, point = max(points.items(), key=lambda item: abs(item[1].deviation))
    measured = all(p.random_sd is not None for p in points.values())
    deviation = f"{point.deviation:+.1f} ({site_tick(key)}, {point.mean:.2f}°)" + ("" if measured else "‡")
    share_key, share = max(points.items(), key=lambda item: item[1].share)
    return deviation, f"{share.share:.4f} ({site_tick(share_key)}; null 1/d = {1 / share.d:.4f})", measured


VERDICT_HEADER = ("| model | norm | runs | step | val loss RMS − LN: uncentred − centred, mean [95% CI] | largest "
                  "(mean angle to 1 − 90°) / null sd, at the norm inputs | largest share of ‖x‖² along 1 at the norm "
                  "inputs | ablation: Δ loss with the centring removed (LN) or added (RMS) at every norm [95% CI] |\n"
                  "|---|---|---:|---:|---|---|---|---|")


def loss_text(interval: Interval) -> str:
    if interval.low is None:
        return interval.text()
    verdict = "**excludes 0**" if interval.excludes_zero else "includes 0"
    return f"{interval.text()}, {interval.n} pairs, {verdict}"


def verdict_rows(group: Group) -> list[str]:
    rows = []
    model = f"{group.title}†" if group.model in DEMO_MODELS else group.title
    for variant in group.variants():
        runs, s = group.compared(variant), group.series_of(variant)
        if not runs:
            continue
        steps = sorted({r.val_step for r in runs})
        if variant.centred:
            loss = "reference" if any(c.centred == variant.name for c in group.comparisons) else "no pair"
        else:
            found = [c for c in group.comparisons if c.uncentred == variant.name]
            loss = f"vs {found[0].centred}: {loss_text(found[0].interval)}" if found else "no pair"
        deviation, share, _ = angle_cells(s)
        ablation = ablation_cell(s, f"normlab-ablate model_path={runs[0].dir}")
        rows.append(f"| {model} | {variant.name} | {len(runs)} | {', '.join(f'{x:,}' for x in steps)} | {loss} | "
                    f"{deviation} | {share} | {ablation} |")
    left_out = [r for r in group.runs if r.left_out]
    if not rows and left_out:
        rows.append(f"| {model} | — | 0 | — | nothing compared: {runs_text(len(left_out))} left out (see below) "
                    "| | | |")
    return rows


def pretrained_row(model: Pretrained) -> str:
    (s,) = model.series()
    deviation, share, _ = angle_cells(s)
    source = next((r.get("source") for r in model.angles if r.get("source")), "<the model's directory>")
    step = last_step(model.angles)
    return (f"| {model.name} (pretrained) | {s.norm} | 1 | {step:,} | pretrained: no loss comparison | {deviation} | "
            f"{share} | {ablation_cell(s, f'normlab-ablate model_path={source}')} |")


HOW_TO_READ = """\
How to read it: each row is one model size and norm; runs of one size differ only in the norm and the seed, and an
LN and an RMS run of the same seed start from the same weights and see the same batches. The loss column is the
paired difference of final validation loss, uncentred minus centred (RMS − LN), averaged over seeds with a t-based
95% interval: an interval that excludes 0 means the seeds agree on which norm is better at this size. The angle
column says how far the norm inputs' mean angle to 1 is from 90°, in standard deviations of the same mean angle to
random directions (|value| ≲ 2: 1 is no more special than a random direction), and the share column how much of their
squared norm lies along 1, which is what LayerNorm's mean subtraction removes (a random direction holds 1/d). In a
pre-norm model every reader of the residual stream is a norm layer, so in an LN model the component along 1 is
removed before anything reads it: the loss cannot see it, and an LN model's orthogonality to 1 is partly by
construction; the RMS model is the informative one (if its inputs are as orthogonal to 1 as random directions, there
is nothing for the mean subtraction to remove), and the ablation asks the trained model directly: Δ loss when LN's
mean subtraction is removed, or RMS's inputs are centred, at every norm (≈ 0: the centring does no work there).
"""


def footnotes(groups: list[Group], pretrained: list[Pretrained]) -> str:
    notes = []
    if any(g.model in DEMO_MODELS for g in groups):
        notes.append(f"† {DEMO_NOTE}.")
    series = [s for g in groups for s in g.series()] + [s for m in pretrained for s in m.series()]
    if any(not angle_cells(s)[2] for s in series):
        notes.append("‡ null sd of a mean over independent tokens, (180/π)/√d/√count: these angles.csv files have "
                     "no null_random_std_deg (the spread of the mean angle over random directions). Tokens of a text "
                     "are not independent, so this null is far too narrow and these deviations are overstated: "
                     "measure again with the current normlab-angles for the right null.")
    return "".join(f"{n}\n\n" for n in notes)
