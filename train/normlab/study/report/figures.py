"""The report's figures beside the per-layer one (probe/figure.py): the loss curves with the paired difference of
validation loss along training, the paired final validation loss (of one norm in place of another among them), the
angles beside random references, the angles across training and the ablation, with the same colours, markers and
legends and a title that names the step; and which figures a group of runs or a pretrained model gets, each as PDF
and PNG. The `*_figure` functions build a matplotlib Figure (None where there is nothing to draw); draw_group and
draw_pretrained save them."""

import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from normlab.probe.figure import (
    HATCHES,
    SEED_LINES,
    SEED_MARKERS,
    AngleSeries,
    angles_by_layer_figure,
    legend_below,
    norm_styles,
    null_bands,
    offsets,
    save,
    site_axis,
    steps_title,
)
from normlab.probe.profiles import ROLE_TICKS, profile, runs_text, site_key, site_sort
from normlab.probe.table import REFERENCES
from normlab.study.report.groups import Comparison, Group, Series, last_rows
from normlab.study.report.intervals import Interval
from normlab.study.report.pretrained import Pretrained

STYLE = {"font.size": 8, "axes.titlesize": 8, "legend.fontsize": 6.5, "axes.labelsize": 8, "pdf.fonttype": 42}
REFERENCE_LABELS = {"uniform": "uniform vector 1", "random_a": "random direction a~ (length √d)",
                    "random_b": "random direction b~ (length √d/2: a second random direction, as an angle "
                                "ignores length)"}
REFERENCE_MARKERS = {"uniform": "o", "random_a": "s", "random_b": "^"}
REFERENCE_COLORS = {"uniform": "tab:green", "random_a": "tab:purple", "random_b": "tab:orange"}
DIFFERENCE_LABEL = "val loss, uncentred − centred,\npaired by seed\n(nats/token; > 0: centring helps)"


def references_figure(title: str, series: list[Series]) -> Figure | None:
    """Per norm, at the norm inputs, the angle to 1 beside the angles to two random directions a~ and b~ (b~ is
    half as long, which an angle cannot see: it is a second random direction), against the null band: what an
    unremarkable direction looks like, to judge 1's angle by."""
    profiles = {(s.norm, ref): profile(s.angles, "input", ref) for s in series for ref in REFERENCES}
    keys = sorted({k for p in profiles.values() for k in p}, key=site_sort)
    if not keys:
        return None
    fig, axes = plt.subplots(1, len(series), figsize=(3.6 * len(series), 3.8), sharey=True, squeeze=False,
                             layout="constrained")
    for ax, s in zip(axes[0], series):
        for reference, dx in zip(REFERENCES, offsets(len(REFERENCES))):
            points = profiles[(s.norm, reference)]
            xs = [keys.index(k) for k in points]
            if reference == "uniform":
                null_bands(ax, xs, list(points.values()), "grey", "")
            ax.errorbar([x + dx for x in xs], [p.mean for p in points.values()],
                        yerr=[p.token_sd for p in points.values()], fmt=REFERENCE_MARKERS[reference], ms=3,
                        capsize=1.5, lw=0.8, color=REFERENCE_COLORS[reference], label=REFERENCE_LABELS[reference])
        ax.set_title(f"{s.norm}: norm inputs")
        site_axis(ax, keys)
    axes[0][0].set_ylabel("angle (degrees): mean, bars ± std over tokens")
    legend_below(fig, axes[0], ncols=1)
    steps = {step for p in profiles.values() for point in p.values() for step in point.steps}
    fig.suptitle(f"{title}: the angle to 1 beside two random directions, {steps_title(steps)}")
    return fig


def thousands(value, _position=None) -> str:
    return f"{value / 1000:g}K" if abs(value) >= 1000 else f"{value:g}"


def angles_training_figure(title: str, series: list[Series]) -> Figure | None:
    """The paper's across-training figure: per norm input, the angle to 1 at every measured step (symlog steps:
    0, then 1K..10K and 20K..100K evenly), every norm overlaid; None for fewer than two measured steps."""
    steps = sorted({r["step"] for s in series for rows in s.angles for r in rows})
    if len(steps) < 2:
        return None
    styles = norm_styles(series)
    by_step = {(s.norm, step): profile(s.angles, "input", "uniform", step) for s in series for step in steps}
    keys = sorted({k for p in by_step.values() for k in p}, key=site_sort)
    cols = min(4, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.9 * cols, 1.6 * rows + 1.2), sharex=True, sharey=True,
                             squeeze=False, layout="constrained")
    linthresh = min(s for s in steps if s > 0)
    for i, (ax, key) in enumerate(zip(axes.flat, keys)):
        for k, (s, dx) in enumerate(zip(series, offsets(len(series)))):
            points = [(step, by_step[(s.norm, step)][key]) for step in steps if key in by_step[(s.norm, step)]]
            if not points:
                continue
            xs, values = zip(*points)
            null_bands(ax, list(xs), list(values), styles[s.norm].color, s.norm, per_site=False,
                       hatch=HATCHES[k % len(HATCHES)])
            shifted = [x * 10 ** (0.15 * dx) if x > 0 else dx * linthresh for x in xs]  # bars side by side
            ax.errorbar(shifted, [p.mean for p in values], yerr=[p.token_sd for p in values],
                        marker=styles[s.norm].marker, ms=2, lw=0.8, capsize=1, color=styles[s.norm].color,
                        label=f"{s.norm}: mean of {runs_text(len(s.angles))}, bars ± std over tokens")
        ax.set_xscale("symlog", linthresh=linthresh)
        if len(steps) <= 6:
            ax.set_xticks(steps)
        ax.xaxis.set_major_formatter(FuncFormatter(thousands))
        ax.tick_params(axis="x", labelbottom=i + cols >= len(keys), labelrotation=90)
        if i + cols >= len(keys):
            ax.set_xlabel("step (symlog)")
        ax.set_title("final norm input" if key[1] == "final_norm" else f"layer {key[0]} {ROLE_TICKS.get(key[1])} input")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    legend_below(fig, axes.flat)
    fig.supylabel("angle to 1 (degrees)")
    fig.suptitle(f"{title}: the norm inputs' angle to 1 during training ({steps_title(steps)})")
    return fig


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def paired_validation(comparison: Comparison) -> tuple[list[int], list[list[float]]]:
    """The validation steps (optimizer steps done) that every run of the comparison logged, and per pair (seed) the
    uncentred − centred validation loss at each of them."""
    losses = [[dict(run.metrics.get("val/loss", [])) for run in pair] for pair in comparison.pairs]
    logged = sorted(set.intersection(*[set(loss) for pair in losses for loss in pair]))
    return [s + 1 for s in logged], [[uncentred[s] - centred[s] for s in logged] for centred, uncentred in losses]


def seed_style(seeds: list[int], seed: int) -> dict:
    """The line style and marker of a seed, the same in every panel of a figure."""
    k = seeds.index(seed)
    return {"ls": SEED_LINES[k % len(SEED_LINES)], "marker": SEED_MARKERS[k % len(SEED_MARKERS)]}


def wrapped(label: str, width: int) -> str:
    """A comparison's label on lines short enough for a panel's title or a tick: its parenthesis below the names, in
    lines of at most `width` characters."""
    names, _, what = label.partition(" (")
    return "\n".join([names, *textwrap.wrap(f"({what}", width)]) if what else label


def draw_differences(ax, comparison: Comparison, seeds: list[int]) -> None:
    """One comparison's paired difference of validation loss along training: each seed's (grey, its line style and
    marker), their mean (black) and its t 95% interval over the seeds (grey band), the final step annotated."""
    steps, differences = paired_validation(comparison)
    label = comparison.label if comparison.centring else wrapped(comparison.label, 50)  # the longer label
    ax.axhline(0, color="black", lw=0.6)
    if not steps:
        ax.set_title(label)
        ax.text(0.5, 0.5, "no validation step common to all its runs", transform=ax.transAxes, ha="center")
        return
    for (centred, _), values in zip(comparison.pairs, differences):
        ax.plot(steps, values, color="tab:gray", lw=0.7, ms=2.5, label=f"seed {centred.seed}: its pair's difference",
                **seed_style(seeds, centred.seed))
    intervals = [Interval.of(list(at)) for at in zip(*differences)]
    n, final = len(differences), intervals[-1]
    over = f"{n} seed{'s' * (n > 1)}"
    ax.plot(steps, [i.mean for i in intervals], color="black", lw=1.2,
            label=f"mean over {over}" if n > 1 else "the one pair: no interval")
    if n > 1:
        ax.fill_between(steps, [i.low for i in intervals], [i.high for i in intervals], color="black", alpha=0.15,
                        lw=0, label=f"t 95% interval over {over}")
    ax.plot([steps[-1]], [final.mean], "D", color="black", ms=4, label="final step (mean, interval: title)")
    ax.set_title(f"{label}\nstep {steps[-1]:,}: {final.text()}")  # the legend: over how many seeds


def losses_figure(group: Group) -> Figure:
    """Training and validation loss of every run of the group on axes of their own (colour: norm, line style and
    marker: seed; unfinished runs and replicates labelled), and below them, per comparison, the paired difference
    of validation loss at each validation step (draw_differences), two to a row."""
    seeds = sorted({r.seed for r in group.runs})
    styles = norm_styles([AngleSeries(group.label(arm), [], style=arm.style) for arm in group.arms()])
    per_row = min(2, max(1, len(group.comparisons)))
    mosaic = [["train"] * per_row + ["val"] * per_row]
    for first in range(0, len(group.comparisons), per_row):  # each under half of the row above
        row = [f"difference {i}" for i in range(first, min(first + per_row, len(group.comparisons)))]
        mosaic.append([panel for panel in row + ["."] * (per_row - len(row)) for _ in range(2)])
    fig, axes = plt.subplot_mosaic(mosaic, figsize=(7.2, 3.4 + 2.6 * (len(mosaic) - 1)), layout="constrained")
    window = 10
    for run in group.runs:
        norm = group.label(run.norm)
        style = {"color": styles[norm].color, "lw": 0.8, "ls": seed_style(seeds, run.seed)["ls"]}
        label = f"{norm} seed {run.seed}" + (" (left out)" if run.left_out else "")
        if run.metrics.get("train/loss"):
            steps, losses = zip(*run.metrics["train/loss"])
            window = max(10, len(losses) // 200)
            axes["train"].plot(steps, smooth(list(losses), window), label=label, **style)
        if run.metrics.get("val/loss"):
            steps, losses = zip(*run.metrics["val/loss"])
            axes["val"].plot([s + 1 for s in steps], losses, ms=2, label=label,
                             marker=seed_style(seeds, run.seed)["marker"], **style)
    axes["train"].set(title=f"training loss (moving average of {window} steps)", ylabel="cross-entropy (nats/token)")
    axes["val"].set(title="validation loss (its own y axis)", ylabel="cross-entropy (nats/token)")
    for i, comparison in enumerate(group.comparisons):
        draw_differences(axes[f"difference {i}"], comparison, seeds)
        if not comparison.centring:  # its own y label
            axes[f"difference {i}"].set_ylabel(f"val loss, {comparison.other} − {comparison.base},\npaired by seed\n"
                                               f"(nats/token; > 0: {comparison.base} better)")
        elif i == 0:
            axes[f"difference {i}"].set_ylabel(DIFFERENCE_LABEL)
    for ax in axes.values():
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_formatter(FuncFormatter(thousands))
    legend_below(fig, [axes["val"], *axes.values()], ncols=3)  # the runs' handles with the seed's marker
    last = steps_title(run.val_step for run in group.runs)
    fig.suptitle(f"{group.title}: loss by optimizer step (last validation: {last})")
    return fig


def loss_differences_figure(group: Group) -> Figure | None:
    """Per comparison: each seed's paired difference of final validation loss, their mean and its t 95% interval
    over the seeds (none for one pair); None without a comparison."""
    comparisons = group.comparisons
    if not comparisons:
        return None
    replaced = sum(not c.centring for c in comparisons)  # their labels are longer
    fig, ax = plt.subplots(figsize=(2.4 + 1.2 * len(comparisons) + 0.8 * replaced, 3.4), layout="constrained")
    for x, comparison in enumerate(comparisons):
        differences, interval = comparison.differences, comparison.interval
        xs = [x - 0.2 + dx / 2 for dx in offsets(len(differences))]  # left of the mean and its interval
        ax.plot(xs, differences, "o", ms=3, color="tab:gray", label="one seed's pair (its seed beside it)")
        for xi, (centred, _), value in zip(xs, comparison.pairs, differences):
            ax.annotate(f"{centred.seed}", (xi, value), fontsize=5, xytext=(2, 2), textcoords="offset points")
        if interval.low is None:
            ax.plot([x + 0.15], [interval.mean], "D", ms=4, color="black", label="the one pair: no interval")
        else:
            errors = [[interval.mean - interval.low], [interval.high - interval.mean]]
            ax.errorbar([x + 0.15], [interval.mean], yerr=errors, fmt="D", ms=4, capsize=4, color="black",
                        label=f"mean, t 95% interval over {interval.n} seeds")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(range(len(comparisons)), [wrapped(c.label, 30) for c in comparisons])
    ax.set_xlim(-0.6, len(comparisons) - 0.4)
    if replaced:  # one norm in place of another among them: not a centring's effect
        ax.set_ylabel("final val loss, first − second norm\n(nats/token; > 0: the second is better)")
    else:
        ax.set_ylabel("final val loss, uncentred − centred\n(nats/token; > 0: centring helps)")
    ax.grid(alpha=0.3, axis="y")
    legend_below(fig, [ax], ncols=1)
    final = steps_title(run.val_step for c in comparisons for pair in c.pairs for run in pair)
    ax.set_title(f"{group.title}\nfinal validation loss ({final}), paired by seed")
    return fig


def ablation_figure(title: str, series: list[Series]) -> Figure | None:
    """normlab-ablate's change of loss per norm site (and all at once), with its CI, every norm and seed overlaid
    (colour: norm, marker: the norm's k-th seed); None without ablation rows."""
    drawn = [(s, k, label, kind, [r for r in last_rows(rows) if (r.get("ablation") or "") == kind])
             for s in series for k, (label, rows) in enumerate(zip(s.labels, s.ablations))
             for kind in sorted({r.get("ablation") or "" for r in last_rows(rows)})]
    if not drawn:
        return None
    styles = norm_styles(series)
    keys = sorted({site_key(r) for *_, rows in drawn for r in rows}, key=site_sort)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.3 * len(keys) * len(drawn) ** 0.5 + 2), 3.6), layout="constrained")
    for (s, k, label, kind, rows), dx in zip(drawn, offsets(len(drawn))):
        rows = sorted(rows, key=lambda r: site_sort(site_key(r)))
        deltas = [r["delta"] for r in rows]
        lows = [r["ci_low"] if r.get("ci_low") is not None else r["delta"] for r in rows]
        highs = [r["ci_high"] if r.get("ci_high") is not None else r["delta"] for r in rows]
        errors = [[d - low for d, low in zip(deltas, lows)], [high - d for d, high in zip(deltas, highs)]]
        ax.errorbar([keys.index(site_key(r)) + dx for r in rows], deltas, yerr=errors,
                    fmt=SEED_MARKERS[k % len(SEED_MARKERS)], ms=3, capsize=1.5, lw=0.8,
                    color=styles[s.norm].color, label=" ".join(filter(None, (s.norm, label, kind))))
    ax.axhline(0, color="black", lw=0.6)
    site_axis(ax, keys)
    ax.set_ylabel("Δ loss, ablated − as trained\n(nats/token, 95% bootstrap CI)")
    legend_below(fig, [ax])
    steps = steps_title(r.get("step") for *_, rows in drawn for r in rows)
    pointwise = ", ".join(s.norm for s in series if not s.normalizes)
    before = f"\n{pointwise}: its input centred before its point-wise map" if pointwise else ""
    ax.set_title(f"{title}: centring ablated (LN: removed, RMS: added){before}\ncheckpoints at {steps}")
    return fig


def draw_group(group: Group, out: Path) -> list[str]:
    series = group.series()
    figures = {f"loss_{group.slug}": losses_figure(group),
               f"loss_difference_{group.slug}": loss_differences_figure(group),
               f"angles_by_layer_{group.slug}": angles_by_layer_figure(group.title, series),
               f"references_{group.slug}": references_figure(group.title, series),
               f"angles_training_{group.slug}": angles_training_figure(group.title, series),
               f"ablation_{group.slug}": ablation_figure(group.title, series)}
    return [f for f in (save(fig, out, name) for name, fig in figures.items()) if f]


def draw_pretrained(model: Pretrained, out: Path) -> list[str]:
    title, series = f"{model.name} (pretrained)", model.series()
    figures = {f"angles_by_layer_{model.slug}": angles_by_layer_figure(title, series),
               f"references_{model.slug}": references_figure(title, series),
               f"ablation_{model.slug}": ablation_figure(title, series)}
    return [f for f in (save(fig, out, name) for name, fig in figures.items()) if f]
