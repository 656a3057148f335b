"""The report's figures beside the per-layer one (probe/figure.py): the uncentred runs' reference comparison, the
angles across training, the loss curves, the paired loss differences and the ablation, each as PDF and PNG, with the
same axes, colours and legends; and which figures a group of runs or a pretrained model gets."""

from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

from normlab.probe.figure import (
    NORM_MARKERS,
    legend_below,
    norm_color,
    null_bands,
    offsets,
    plot_angles_by_layer,
    save,
    site_axis,
)
from normlab.probe.profiles import ROLE_TICKS, profile, site_key, site_sort, step_text
from normlab.probe.table import REFERENCES
from normlab.study.report.groups import Group, Series, last_rows
from normlab.study.report.pretrained import Pretrained

STYLE = {"font.size": 8, "axes.titlesize": 8, "legend.fontsize": 6.5, "axes.labelsize": 8, "pdf.fonttype": 42}
REFERENCE_LABELS = {"uniform": "uniform vector 1", "random_a": "random a~ (norm √d)",
                    "random_b": "random b~ (norm √d/2)"}
REFERENCE_MARKERS = {"uniform": "o", "random_a": "s", "random_b": "^"}
REFERENCE_COLORS = {"uniform": "tab:green", "random_a": "tab:purple", "random_b": "tab:orange"}


def plot_references(title: str, series: list[Series], out: Path, name: str) -> str | None:
    """The a~/b~ comparison: per norm, the angle of the norm inputs to 1 beside random a~ (same norm as 1) and b~
    (another norm): is 1 special, and does a reference's norm matter?"""
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
    axes[0][0].set_ylabel("angle (degrees): mean, ± std over tokens")
    legend_below(fig, axes[0])
    fig.suptitle(f"{title}: the uniform vector beside random references, step {step_text(profiles.values())}")
    return save(fig, out, name)


def thousands(value, _position=None) -> str:
    return f"{value / 1000:g}K" if abs(value) >= 1000 else f"{value:g}"


def plot_angles_training(title: str, series: list[Series], out: Path, name: str) -> str | None:
    """The paper's across-training figure: per norm input, the angle to 1 at every measured step (symlog steps:
    0, then 1K..10K and 20K..100K evenly), every norm overlaid."""
    steps = sorted({r["step"] for s in series for rows in s.angles for r in rows})
    if len(steps) < 2:
        return None
    norms = [s.norm for s in series]
    by_step = {(s.norm, step): profile(s.angles, "input", "uniform", step) for s in series for step in steps}
    keys = sorted({k for p in by_step.values() for k in p}, key=site_sort)
    cols = min(4, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.9 * cols, 1.6 * rows + 1.2), sharex=True, sharey=True,
                             squeeze=False, layout="constrained")
    linthresh = min(s for s in steps if s > 0)
    for i, (ax, key) in enumerate(zip(axes.flat, keys)):
        for s, dx in zip(series, offsets(len(series))):
            points = [(step, by_step[(s.norm, step)][key]) for step in steps if key in by_step[(s.norm, step)]]
            if not points:
                continue
            xs, values = zip(*points)
            null_bands(ax, list(xs), list(values), norm_color(s.norm, norms), s.norm, per_site=False)
            shifted = [x * 10 ** (0.15 * dx) if x > 0 else dx * linthresh for x in xs]  # bars side by side
            ax.errorbar(shifted, [p.mean for p in values], yerr=[p.token_sd for p in values], fmt="o-", ms=2, lw=0.8,
                        capsize=1, color=norm_color(s.norm, norms), label=s.norm)
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
    fig.supylabel("angle to 1 (degrees): mean, ± std over tokens")
    fig.suptitle(f"{title}: the norm inputs' angle to 1 during training")
    return save(fig, out, name)


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_losses(group: Group, out: Path, name: str) -> str:
    """Training and validation loss of every run of the group, the norms overlaid (unfinished runs marked)."""
    norms = [v.name for v in group.variants()]
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(7.2, 3.4), sharey=True, layout="constrained")
    window, seeds = 10, sorted({r.seed for r in group.runs})
    for run in group.runs:
        color, style = norm_color(run.variant.name, norms), ("-", "--", ":", "-.")[seeds.index(run.seed) % 4]
        label = f"{run.variant.name} seed {run.seed}" + (" (left out)" if run.left_out else "")
        if run.metrics.get("train/loss"):
            steps, losses = zip(*run.metrics["train/loss"])
            window = max(10, len(losses) // 200)
            ax_train.plot(steps, smooth(list(losses), window), color=color, ls=style, lw=0.8, label=label)
        if run.metrics.get("val/loss"):
            steps, losses = zip(*run.metrics["val/loss"])
            ax_val.plot([s + 1 for s in steps], losses, "o", ls=style, color=color, ms=2, lw=0.8, label=label)
    ax_train.set(title=f"training loss (moving average of {window} steps)", xlabel="optimizer step",
                 ylabel="cross-entropy (nats/token)")
    ax_val.set(title="validation loss", xlabel="optimizer step")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_formatter(FuncFormatter(thousands))
    legend_below(fig, [ax_val])
    fig.suptitle(group.title)
    return save(fig, out, name)


def plot_loss_differences(group: Group, out: Path, name: str) -> str | None:
    """Per comparison: each seed's paired difference of final validation loss, their mean and its 95% CI."""
    comparisons = group.comparisons
    if not comparisons:
        return None
    fig, ax = plt.subplots(figsize=(2.4 + 1.2 * len(comparisons), 3.4), layout="constrained")
    for x, comparison in enumerate(comparisons):
        differences, interval = comparison.differences, comparison.interval
        xs = [x - 0.2 + dx / 2 for dx in offsets(len(differences))]  # left of the mean and its interval
        ax.plot(xs, differences, "o", ms=3, color="tab:gray", label="one seed's pair" if x == 0 else None)
        for xi, (centred, _), value in zip(xs, comparison.pairs, differences):
            ax.annotate(f"{centred.seed}", (xi, value), fontsize=5, xytext=(2, 2), textcoords="offset points")
        low, high = (interval.low, interval.high) if interval.low is not None else (interval.mean, interval.mean)
        ax.errorbar([x + 0.15], [interval.mean], yerr=[[interval.mean - low], [high - interval.mean]], fmt="D",
                    ms=4, capsize=4, color="black", label="mean, 95% CI (t)" if x == 0 else None)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(range(len(comparisons)), [c.label.replace(" (", "\n(") for c in comparisons])
    ax.set_xlim(-0.6, len(comparisons) - 0.4)
    ax.set_ylabel("final val loss, uncentred − centred\n(nats/token; > 0: centring helps)")
    ax.grid(alpha=0.3, axis="y")
    legend_below(fig, [ax])
    ax.set_title(f"{group.title}: paired by seed")
    return save(fig, out, name)


def plot_ablation(title: str, series: list[Series], out: Path, name: str) -> str | None:
    """normlab-ablate's change of loss per norm site (and all at once), with its CI, every norm and seed overlaid."""
    drawn = [(s, label, kind, [r for r in last_rows(rows) if (r.get("ablation") or "") == kind])
             for s in series for label, rows in zip(s.labels, s.ablations)
             for kind in sorted({r.get("ablation") or "" for r in last_rows(rows)})]
    if not drawn:
        return None
    norms = [s.norm for s in series]
    keys = sorted({site_key(r) for *_, rows in drawn for r in rows}, key=site_sort)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.3 * len(keys) * len(drawn) ** 0.5 + 2), 3.6), layout="constrained")
    for (s, label, kind, rows), dx in zip(drawn, offsets(len(drawn))):
        rows = sorted(rows, key=lambda r: site_sort(site_key(r)))
        deltas = [r["delta"] for r in rows]
        lows = [r["ci_low"] if r.get("ci_low") is not None else r["delta"] for r in rows]
        highs = [r["ci_high"] if r.get("ci_high") is not None else r["delta"] for r in rows]
        errors = [[d - low for d, low in zip(deltas, lows)], [high - d for d, high in zip(deltas, highs)]]
        ax.errorbar([keys.index(site_key(r)) + dx for r in rows], deltas, yerr=errors,
                    fmt=NORM_MARKERS.get(s.norm, "o"), ms=3, capsize=1.5, lw=0.8, color=norm_color(s.norm, norms),
                    label=" ".join(filter(None, (s.norm, label, kind))))
    ax.axhline(0, color="black", lw=0.6)
    site_axis(ax, keys)
    ax.set_ylabel("Δ loss, ablated − as trained\n(nats/token, 95% bootstrap CI)")
    legend_below(fig, [ax])
    ax.set_title(f"{title}: centring ablated (LN: removed, RMS: added)")
    return save(fig, out, name)

def draw_group(group: Group, out: Path) -> list[str]:
    series = group.series()
    figures = [plot_losses(group, out, f"loss_{group.slug}"),
               plot_loss_differences(group, out, f"loss_difference_{group.slug}"),
               plot_angles_by_layer(group.title, series, out, f"angles_by_layer_{group.slug}"),
               plot_references(group.title, series, out, f"references_{group.slug}"),
               plot_angles_training(group.title, series, out, f"angles_training_{group.slug}"),
               plot_ablation(group.title, series, out, f"ablation_{group.slug}")]
    return [f for f in figures if f]


def draw_pretrained(model: Pretrained, out: Path) -> list[str]:
    title, series = f"{model.name} (pretrained)", model.series()
    figures = [plot_angles_by_layer(title, series, out, f"angles_by_layer_{model.slug}"),
               plot_references(title, series, out, f"references_{model.slug}"),
               plot_ablation(title, series, out, f"ablation_{model.slug}")]
    return [f for f in figures if f]
