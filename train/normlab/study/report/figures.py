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
    SEED_LINES,
    SEED_MARKERS,
    AngleSeries,
    Null,
    angles_by_layer_figure,
    finish,
    norm_styles,
    null_bands,
    offsets,
    save,
    site_axis,
    steps_title,
    wrap_label,
)
from normlab.probe.profiles import ROLE_TICKS, profile, runs_text, site_key, site_sort
from normlab.probe.table import REFERENCES
from normlab.study.report.branches import differences_from_k, shares_from_k
from normlab.study.report.groups import Comparison, Group, Series, last_rows
from normlab.study.report.intervals import Interval
from normlab.study.report.pretrained import Pretrained
from normlab.study.report.runs import along_1, null_rows
from normlab.study.report.tuning import Tuning

STYLE = {"font.size": 8, "axes.titlesize": 8, "legend.fontsize": 6.5, "axes.labelsize": 8, "pdf.fonttype": 42}
REFERENCE_LABELS = {"uniform": "uniform vector 1", "random_a": "random direction a~ (length √d)",
                    "random_b": "random direction b~ (length √d/2: a second random direction, as an angle "
                                "ignores length)"}
REFERENCE_MARKERS = {"uniform": "o", "random_a": "s", "random_b": "^"}
REFERENCE_COLORS = {"uniform": "tab:green", "random_a": "tab:purple", "random_b": "tab:orange"}
UNIGRAM_LABEL = "unigram loss (token frequencies only)"
BIGRAM_LABEL = "bigram loss (a count table of next tokens)"
NULL_LABEL = "all, along random directions (null)"
NULL_COLOR = "dimgray"
SEED_COLOR = "tab:gray"  # a seed's own line in the legend, and its paired difference
ANGLE_LABEL = "angle (degrees)\nmean, bars ± std over tokens"
YLABEL_WIDTH = 38  # characters: a y label's line as long as a loss-difference panel is high
TICK_WIDTH = 30  # characters: a line of a comparison's label under its tick


def references_figure(title: str, series: list[Series]) -> Figure | None:
    """Per norm, at the norm inputs, the angle to 1 beside the angles to two random directions a~ and b~ (b~ is
    half as long, which an angle cannot see: it is a second random direction), against the null band: what an
    unremarkable direction looks like, to judge 1's angle by."""
    profiles = {(s.norm, ref): profile(s.angles, "input", ref) for s in series for ref in REFERENCES}
    keys = sorted({k for p in profiles.values() for k in p}, key=site_sort)
    if not keys:
        return None
    cols = min(2, len(series))  # two panels to a printed page's width
    rows = -(-len(series) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows + 0.4), sharey=True, squeeze=False,
                             layout="constrained")
    for ax, s in zip(axes.flat, series):
        uniform = profiles[(s.norm, "uniform")]
        null_bands(ax, [Null([keys.index(k) for k in uniform], list(uniform.values()))])
        for reference, dx in zip(REFERENCES, offsets(len(REFERENCES))):
            points = profiles[(s.norm, reference)]
            xs = [keys.index(k) for k in points]
            ax.errorbar([x + dx for x in xs], [p.mean for p in points.values()],
                        yerr=[p.token_sd for p in points.values()], fmt=REFERENCE_MARKERS[reference], ms=3,
                        capsize=1.5, lw=0.8, color=REFERENCE_COLORS[reference], label=REFERENCE_LABELS[reference])
        ax.set_title(f"{s.norm}: norm inputs")
        site_axis(ax, keys)
    for ax in axes.flat[len(series):]:
        ax.set_visible(False)
    for row in axes:
        row[0].set_ylabel(ANGLE_LABEL)
    steps = {step for p in profiles.values() for point in p.values() for step in point.steps}
    finish(fig, axes.flat, f"{title}:\nthe angle to 1 beside two random directions, {steps_title(steps)}", ncols=1)
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
    fig, axes = plt.subplots(rows, cols, figsize=(1.9 * cols, 1.6 * rows + 0.8), sharex=True, sharey=True,
                             squeeze=False, layout="constrained")
    linthresh = min(s for s in steps if s > 0)
    for i, (ax, key) in enumerate(zip(axes.flat, keys)):
        measured = {s.norm: [(step, by_step[(s.norm, step)][key]) for step in steps if key in by_step[(s.norm, step)]]
                    for s in series}
        null_bands(ax, [Null([step for step, _ in points], [point for _, point in points], norm, styles[norm].color)
                        for norm, points in measured.items()], per_site=False)
        for s, dx in zip(series, offsets(len(series))):
            if not measured[s.norm]:
                continue
            xs, values = zip(*measured[s.norm])
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
        layer, role = key
        ax.set_title("final norm input" if role == "final_norm" else f"layer {layer} {ROLE_TICKS.get(role)} input")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    fig.supylabel("angle to 1 (degrees)")
    finish(fig, axes.flat, f"{title}: the norm inputs' angle to 1 during training ({steps_title(steps)})")
    return fig


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def seed_style(seeds: list[int], seed: int) -> dict:
    """The line style and marker of a seed, the same in every panel of a figure."""
    k = seeds.index(seed)
    return {"ls": SEED_LINES[k % len(SEED_LINES)], "marker": SEED_MARKERS[k % len(SEED_MARKERS)]}


def norm_and_seed_handles(ax, norms: dict[str, str], seeds: list[int]) -> None:
    """The loss figure's legend as colour x style, not a line per run (6 seeds x 5 norms would be 30): each norm's
    colour (`norms`: label -> colour), then each seed's line style and marker in grey, the colour of a seed's paired
    difference. Invisible lines on `ax` that legend_below collects."""
    for label, color in norms.items():
        ax.plot([], [], color=color, lw=1.2, label=label)
    for seed in seeds:
        ax.plot([], [], color=SEED_COLOR, lw=0.8, ms=3, label=f"seed {seed}", **seed_style(seeds, seed))


def wrapped(label: str, width: int) -> str:
    """A comparison's label on lines short enough for a panel's title or a tick: its parenthesis below the names, in
    lines of at most `width` characters."""
    names, _, what = label.partition(" (")
    return "\n".join([names, *textwrap.wrap(f"({what}", width)]) if what else label


def difference_meaning(comparison: Comparison) -> tuple[str, str]:
    """What a paired difference is and what its sign says, from what differs between the two norms: the centring
    alone where the bias is common to both, else all that differs, named by the norms."""
    if comparison.centring and comparison.bias is not None:
        return "uncentred − centred", "uncentred higher"
    return f"{comparison.other} − {comparison.base}", f"{comparison.other} higher than {comparison.base}"


def draw_differences(ax, comparison: Comparison, seeds: list[int]) -> None:
    """One comparison's paired difference of validation loss along training: each seed's (grey, its line style and
    marker), their mean (black) and its t 95% interval over the seeds (grey band), the final step annotated."""
    steps, differences = comparison.validation_differences()
    label = comparison.label if comparison.centring else wrapped(comparison.label, 50)  # the longer label
    difference, sign = difference_meaning(comparison)
    ax.set_ylabel(wrap_label(f"val loss, {difference},\npaired by seed\n(nats/token; > 0: {sign})", YLABEL_WIDTH))
    ax.axhline(0, color="black", lw=0.6)
    if not steps:
        ax.set_title(label)
        ax.text(0.5, 0.5, "no validation step common to all its runs", transform=ax.transAxes, ha="center")
        return
    for (base, _), values in zip(comparison.pairs, differences):  # in the legend as the seed (seed_handles)
        ax.plot(steps, values, color=SEED_COLOR, lw=0.7, ms=2.5, label=f"seed {base.seed}",
                **seed_style(seeds, base.seed))
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


def loss_panels(group: Group) -> dict[str, str]:
    """The loss curves' panels, name -> title: training loss of every run; validation loss of the norms that
    normalize and, on a y axis of its own, of the point-wise layers (DyT's, far above theirs, would squash them)."""
    kinds = {run.norm.traits.normalizes for run in group.runs}
    split = len(kinds) == 2
    panels = {"train": "training loss"}
    if True in kinds:
        panels["val"] = "validation loss:\nnormalizing norms" if split else "validation loss\n(its own y axis)"
    if False in kinds:
        panels["val point-wise"] = "validation loss:\npoint-wise layers"
    return panels


def losses_figure(group: Group) -> Figure:
    """Training and validation loss of every run on axes of their own (loss_panels; colour: norm, line style and
    marker: seed, in the legend once each; unfinished runs and replicates labelled), with the held-out unigram and
    bigram losses where known (a run above them did no more than count tokens or pairs of them), and below them, per
    comparison, the paired
    difference of validation loss at each validation step (draw_differences), two to a row."""
    seeds = sorted({r.seed for r in group.runs})
    styles = norm_styles([AngleSeries(group.label(arm), [], style=arm.style) for arm in group.arms()])
    panels = loss_panels(group)
    per_row = min(2, max(1, len(group.comparisons)))
    width = 6  # mosaic columns: two or three loss panels, one or two difference panels to a row
    mosaic = [[panel for panel in panels for _ in range(width // len(panels))]]
    for first in range(0, len(group.comparisons), per_row):
        row = [f"difference {i}" for i in range(first, min(first + per_row, len(group.comparisons)))]
        mosaic.append([panel for panel in row + ["."] * (per_row - len(row)) for _ in range(width // per_row)])
    heights = [2.6] + [3.2] * (len(mosaic) - 1)  # inches: a difference panel's title has three to five lines
    fig, axes = plt.subplot_mosaic(mosaic, figsize=(7.2, sum(heights)), height_ratios=heights, layout="constrained")
    window = 10
    norm_and_seed_handles(axes["train"], {group.label(a): styles[group.label(a)].color for a in group.arms()}, seeds)
    for run in group.runs:
        norm = group.label(run.norm)
        style = {"color": styles[norm].color, "lw": 0.8, "ls": seed_style(seeds, run.seed)["ls"]}
        # a run is its norm's colour and its seed's style (norm_and_seed_handles); only one left out is named
        label = f"{norm} seed {run.seed} (left out)" if run.left_out else f"_{norm} seed {run.seed}"
        if run.metrics.get("train/loss"):
            steps, losses = zip(*run.metrics["train/loss"])
            window = max(10, len(losses) // 200)
            axes["train"].plot(steps, smooth(list(losses), window), label=label, **style)
        if run.metrics.get("val/loss"):
            steps, losses = zip(*run.metrics["val/loss"])
            panel = "val" if run.norm.traits.normalizes else "val point-wise"
            axes[panel].plot([s + 1 for s in steps], losses, ms=2, label=label,
                             marker=seed_style(seeds, run.seed)["marker"], **style)
    panels["train"] += f"\n(moving average of {window} steps)"
    for panel, title in panels.items():
        axes[panel].set(title=title, ylabel="cross-entropy (nats/token)")
        if group.unigram_loss is not None:
            axes[panel].axhline(group.unigram_loss, color="black", ls="-.", lw=0.9, label=UNIGRAM_LABEL)
        if group.bigram_loss is not None:
            axes[panel].axhline(group.bigram_loss, color="dimgray", ls=":", lw=0.9, label=BIGRAM_LABEL)
    for i, comparison in enumerate(group.comparisons):
        draw_differences(axes[f"difference {i}"], comparison, seeds)
    for ax in axes.values():
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_formatter(FuncFormatter(thousands))
    last = steps_title(run.val_step for run in group.runs)
    finish(fig, axes.values(), f"{group.title}: loss by optimizer step (last validation: {last})", ncols=3)
    return fig


def pointwise(comparison: Comparison) -> bool:
    """Whether a norm of the comparison does not normalize (DyT): its difference, far from those of the norms that
    do, gets an axis of its own."""
    return not (comparison.base_traits.normalizes and comparison.other_traits.normalizes)


def draw_final_differences(ax, comparisons: list[Comparison], intervals: dict[str, Interval]) -> None:
    """Per comparison: each seed's paired difference of final validation loss, their mean and its t 95% interval
    over the seeds (none for one pair), with a y label that says what a difference above 0 means."""
    for x, comparison in enumerate(comparisons):
        differences = comparison.differences
        interval = intervals.get(comparison.label, comparison.interval)  # the family's
        xs = [x - 0.2 + dx / 2 for dx in offsets(len(differences))]  # left of the mean and its interval
        ax.plot(xs, differences, "o", ms=3, color="tab:gray", label="one seed's pair (its seed beside it)")
        for xi, (base, _), value in zip(xs, comparison.pairs, differences):
            ax.annotate(f"{base.seed}", (xi, value), fontsize=5, xytext=(2, 2), textcoords="offset points")
        if interval.low is None:
            ax.plot([x + 0.15], [interval.mean], "D", ms=4, color="black", label="the one pair: no interval")
        else:
            errors = [[interval.mean - interval.low], [interval.high - interval.mean]]
            ax.errorbar([x + 0.15], [interval.mean], yerr=errors, fmt="D", ms=4, capsize=4, color="black",
                        label=f"mean, t 95% interval over {interval.n} seeds")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(range(len(comparisons)), [wrapped(c.label, TICK_WIDTH) for c in comparisons])
    ax.set_xlim(-0.6, len(comparisons) - 0.4)
    meanings = {difference_meaning(c) for c in comparisons}
    if len(meanings) == 1:  # one difference in every comparison (the centring alone, or one pair of norms)
        ((difference, sign),) = meanings
        ax.set_ylabel(wrap_label(f"final val loss,\n{difference}\n(nats/token; > 0: {sign})", YLABEL_WIDTH))
    else:  # the norms named in each tick's label
        ax.set_ylabel("final val loss,\nas each label reads\n(nats/token; > 0: its first norm higher)")
    ax.grid(alpha=0.3, axis="y")


def loss_differences_figure(group: Group, intervals: dict[str, Interval] | None = None) -> Figure | None:
    """The final step's paired differences (draw_final_differences): those between norms that normalize, and below
    them, on an axis of their own, those with a point-wise layer; None without a comparison. `intervals`: the family's
    (intervals_of) by comparison label; each comparison's own paired t where it has none."""
    kinds = [[c for c in group.comparisons if pointwise(c) == kind] for kind in (False, True)]
    kinds = [comparisons for comparisons in kinds if comparisons]
    if not kinds:
        return None
    width = max(1.8 * len(comparisons) + 0.6 * sum(not c.centring for c in comparisons) for comparisons in kinds)
    ticks = max(len(wrapped(c.label, TICK_WIDTH).splitlines()) for c in group.comparisons)  # lines of the longest
    fig, axes = plt.subplots(len(kinds), 1, figsize=(1.6 + width, (1.9 + 0.13 * ticks) * len(kinds)), squeeze=False,
                             layout="constrained")
    for (ax,), comparisons in zip(axes, kinds):
        draw_final_differences(ax, comparisons, intervals or {})
        if len(kinds) == 2:
            ax.set_title("with a point-wise layer" if pointwise(comparisons[0]) else "between normalizing norms")
    runs = [run for c in group.comparisons for pair in c.pairs for run in pair]
    finish(fig, axes.flat, f"{group.title}\nfinal validation loss ({final_title(runs)}), paired by seed", ncols=1)
    return fig


def final_title(runs) -> str:
    """What the runs' final losses average: "step 1,600", or "the mean of 4 validations, steps 1,450-1,600"."""
    steps = sorted({s for run in runs for s, _ in run.final_validations})
    counts = {len(run.final_validations) for run in runs}
    if len(steps) < 2 or counts == {1}:
        return steps_title(run.val_step for run in runs)
    count = f"{counts.pop()} validations" if len(counts) == 1 else "validations"
    return f"the mean of {count}, steps {steps[0]:,}-{steps[-1]:,}"


ROLE_LEGENDS = {"": "the centring's work", "control": "the control: rounding alone",
                "restart": "what the restart costs"}  # a branch group's comparisons (groups.BRANCH_ROLES)


def branch_figure(group: Group) -> Figure | None:
    """A group of branches from its step K (branches.py): left, each comparison's mean paired difference of
    validation loss with its pointwise t band over the seeds (in the colour of the arm it subtracts from), the
    control's the floor of rounding; right, each arm's
    share of ||x||^2 along 1 at the norm inputs (mean over the sites, and the largest site's), beside a random
    direction's median share. None for any other group."""
    if group.branch_step is None or not group.comparisons:
        return None
    styles = norm_styles(group.series() or [AngleSeries(group.label(a), [], style=a.style) for a in group.arms()])
    fig, (loss, share) = plt.subplots(1, 2, figsize=(7.2, 3.2), layout="constrained")
    for comparison in group.comparisons:
        found = differences_from_k(comparison)
        if not found:
            continue
        steps, intervals = [d.step for d in found], [d.interval for d in found]
        color = styles[comparison.other].color if comparison.other in styles else "black"  # as in the right panel
        loss.plot(steps, [i.mean for i in intervals], color=color, lw=1.1,
                  label=f"{comparison.other} − {comparison.base}: {ROLE_LEGENDS[comparison.role]}")
        if all(i.low is not None for i in intervals):
            loss.fill_between(steps, [i.low for i in intervals], [i.high for i in intervals], color=color, alpha=0.15,
                              lw=0)
    loss.axhline(0, color="black", lw=0.6)
    loss.set(title="validation loss, paired by source and seed:\nmean, band: t 95% over the seeds at each step",
             ylabel="difference (nats/token)")
    null_drawn = False
    for series in group.series():
        found = shares_from_k(series, group.branch_step)
        if not found:
            continue
        steps, color = [s.step for s in found], styles[series.norm].color
        share.plot(steps, [s.mean_share for s in found], color=color, lw=1.1, marker="o", ms=2.5,
                   label=f"{series.norm}: mean over the norm inputs")
        share.plot(steps, [s.largest for s in found], color=color, lw=0.7, ls="--",
                   label=f"{series.norm}: the largest site")
        medians = [(s.step, s.null_median) for s in found if s.null_median is not None]
        if medians and not null_drawn:
            share.plot(*zip(*medians), color="black", ls=":", lw=0.9, label="a random direction: median share")
            null_drawn = True
    share.set(title="share of ‖x‖² along 1 at the norm inputs\n(seed means)", ylabel="mean cos² along 1")
    for ax in (loss, share):
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_formatter(FuncFormatter(thousands))
    finish(fig, [loss, share], f"{group.title}: the branches from step {group.branch_step:,} on", ncols=2)
    return fig


def ablation_figure(title: str, series: list[Series]) -> Figure | None:
    """normlab-ablate's change of loss per norm site (and all at once), with its CI: a panel per norm (and kind of
    ablation), its seeds (or models) side by side at each site, each with its marker in every panel; None without
    ablation rows. Panels of their own keep a norm's scale (an RMS model's +0.1 would flatten an LN one's 0.002) and
    the legend to one entry per seed, not one per run."""
    panels = []  # (series, kind of ablation, [(seed or model, its rows of that kind at its newest step)])
    nulls = {}  # (norm, kind): the null's deltas, every norm at once along random directions, of every run
    for s in series:
        newest = [(label, last_rows(rows)) for label, rows in zip(s.labels, s.ablations)]
        for kind in {r.get("ablation") or "" for _, rows in newest for r in null_rows(rows)}:
            nulls[s.norm, kind] = [r["delta"] for _, rows in newest for r in null_rows(rows)
                                   if (r.get("ablation") or "") == kind]
        newest = [(label, along_1(rows)) for label, rows in newest]
        for kind in sorted({r.get("ablation") or "" for _, rows in newest for r in rows}):
            panels.append((s, kind, [(label, of_kind) for label, rows in newest
                                     if (of_kind := [r for r in rows if (r.get("ablation") or "") == kind])]))
    if not panels:
        return None
    styles = norm_styles(series)
    labels = list(dict.fromkeys(label for *_, runs in panels for label, _ in runs))
    markers = {label: SEED_MARKERS[k % len(SEED_MARKERS)] for k, label in enumerate(labels)}  # the same in each panel
    keys = sorted({site_key(r) for *_, runs in panels for _, rows in runs for r in rows}, key=site_sort)
    most = max(len(runs) for *_, runs in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(4.0, 0.3 * len(keys) * most ** 0.5 + 2),
                                                      0.5 + 1.4 * len(panels)), squeeze=False, layout="constrained")
    for i, ((ax,), (s, kind, runs)) in enumerate(zip(axes, panels)):
        for (label, rows), dx in zip(runs, offsets(len(runs))):
            rows = sorted(rows, key=lambda r: site_sort(site_key(r)))
            deltas = [r["delta"] for r in rows]
            lows = [r["ci_low"] if r.get("ci_low") is not None else r["delta"] for r in rows]
            highs = [r["ci_high"] if r.get("ci_high") is not None else r["delta"] for r in rows]
            errors = [[d - low for d, low in zip(deltas, lows)], [high - d for d, high in zip(deltas, highs)]]
            ax.errorbar([keys.index(site_key(r)) + dx for r in rows], deltas, yerr=errors, fmt=markers[label], ms=3,
                        capsize=1.5, lw=0.8, color=styles[s.norm].color,
                        label="_" + " ".join(filter(None, (s.norm, label, kind))))
        if null := nulls.get((s.norm, kind)):  # beside "all": the same ablation along random directions
            ax.plot([keys.index((-1, "all")) + 0.35] * len(null), null, "_", color=NULL_COLOR, ms=5, mew=0.8,
                    label="_null")
        ax.axhline(0, color="black", lw=0.6)
        site_axis(ax, keys)
        ax.tick_params(labelbottom=i == len(panels) - 1)  # the sites named once, below the last panel
        ax.set_title(" ".join(filter(None, (f"{s.norm}:", kind or "ablated", "" if s.normalizes else
                                            "(its input, before its point-wise map)"))))
        ax.set_ylabel("Δ loss\n(nats/token)")
    for label, marker in markers.items():
        axes[0][0].plot([], [], marker, color=SEED_COLOR, ms=3, label=label)
    if nulls:
        axes[0][0].plot([], [], "_", color=NULL_COLOR, ms=5, mew=0.8, label=NULL_LABEL)
    steps = steps_title(r.get("step") for *_, runs in panels for _, rows in runs for r in rows)
    finish(fig, axes.flat, f"{title}: centring ablated (LN: removed, RMS: added)\nΔ loss, ablated − as trained "
           f"(95% CI)\ncheckpoints at {steps}", ncols=6)
    return fig


def tuning_figure(tuning: Tuning) -> Figure | None:
    """Each norm's final loss against the setting swept (log axis), its best ringed, a diverged value marked with an x
    at the top edge (no loss to draw); the bigram bar where known."""
    if not tuning.points:
        return None
    styles = norm_styles([AngleSeries(c.norm, []) for c in tuning.choices])
    fig, ax = plt.subplots(figsize=(4.8, 3.4), layout="constrained")
    for c in tuning.choices:
        mine = [p for p in tuning.points if p.norm == c.norm]
        finite = [p for p in mine if p.final_val_loss < float("inf")]
        style = styles[c.norm]
        ax.plot([p.value for p in finite], [p.final_val_loss for p in finite], color=style.color,
                marker=style.marker, ms=4, lw=0.9, label=f"{c.norm}: best {c.best:g} ({c.advice})")
        ax.plot([c.best], [c.final_val_loss], "o", mfc="none", mec=style.color, ms=10, label="_best")
        diverged = [p.value for p in mine if p not in finite]
        ax.plot(diverged, [0.97] * len(diverged), "x", color=style.color, ms=7, label="_diverged",
                transform=ax.get_xaxis_transform())
    if tuning.bigram_loss is not None:
        ax.axhline(tuning.bigram_loss, color="dimgray", ls=":", lw=0.9, label=BIGRAM_LABEL)
    ax.set(xscale="log", xlabel=tuning.key, ylabel="final validation loss (nats/token)")
    ax.grid(alpha=0.3)
    finish(fig, [ax], f"{tuning.title}: each norm's final loss by {tuning.key} (ringed: its best; x: diverged)",
           ncols=1)
    return fig


def draw_group(group: Group, out: Path, intervals: dict[str, Interval]) -> list[str]:
    """The group's figures into `out`; `intervals`: the family's interval of each comparison (intervals_of)."""
    series = group.series()
    figures = {f"loss_{group.slug}": losses_figure(group),
               f"loss_difference_{group.slug}": loss_differences_figure(group, intervals),
               f"angles_by_layer_{group.slug}": angles_by_layer_figure(group.title, series),
               f"references_{group.slug}": references_figure(group.title, series),
               f"angles_training_{group.slug}": angles_training_figure(group.title, series),
               f"ablation_{group.slug}": ablation_figure(group.title, series),
               f"branch_{group.slug}": branch_figure(group)}
    return [f for f in (save(fig, out, name) for name, fig in figures.items()) if f]


def draw_pretrained(model: Pretrained, out: Path) -> list[str]:
    title, series = f"{model.name} (pretrained)", model.series()
    figures = {f"angles_by_layer_{model.slug}": angles_by_layer_figure(title, series),
               f"references_{model.slug}": references_figure(title, series),
               f"ablation_{model.slug}": ablation_figure(title, series)}
    return [f for f in (save(fig, out, name) for name, fig in figures.items()) if f]
