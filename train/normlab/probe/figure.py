"""The per-layer angle figure (the angle to 1 at the norms' inputs and outputs, every norm overlaid, with the null
each mean angle is compared with) and the drawing conventions the report's other figures share: colours and markers
per norm, one tick per norm site, null bands, one legend below the panels, PDF and PNG at print resolution.
Training's angle callback draws it for each probe, the report for each group of runs and pretrained model."""

import logging
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from normlab.probe.profiles import Point, profile, runs_text, site_sort, site_tick, step_text

matplotlib.use("Agg")  # files only, no display (no figure exists yet, so switching after pyplot's import is allowed)
logging.getLogger("fontTools").setLevel(logging.WARNING)  # its font subsetting for the PDF files says every step

DPI = 300  # print resolution of the PNG files (the PDF files are vector graphics)
NORM_COLORS = {"layernorm": "tab:blue", "rmsnorm": "tab:red", "layernorm_nobias": "tab:purple",
               "rmsnorm_bias": "tab:orange"}
OTHER_COLORS = ("tab:green", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")
NORM_MARKERS = {"layernorm": "o", "rmsnorm": "s", "layernorm_nobias": "^", "rmsnorm_bias": "D"}


@dataclass
class AngleSeries:
    """What one norm contributes to an angle figure: the angle rows of its runs (seeds), or of one pretrained
    model."""
    norm: str
    angles: list[list[dict]]  # per run


def norm_color(norm: str, norms: list[str]) -> str:
    return NORM_COLORS.get(norm) or OTHER_COLORS[norms.index(norm) % len(OTHER_COLORS)]


def save(fig, out: Path, name: str) -> str:
    fig.savefig(out / f"{name}.pdf", dpi=DPI)
    fig.savefig(out / f"{name}.png", dpi=DPI)
    plt.close(fig)
    return f"{name}.png"


def offsets(count: int) -> list[float]:
    """x offsets of `count` series around a tick, so that error bars never cover each other."""
    width = min(0.8 / count, 0.18)
    return [(k - (count - 1) / 2) * width for k in range(count)]


def site_axis(ax, keys: list[tuple]) -> None:
    ax.set_xticks(range(len(keys)), [site_tick(k) for k in keys], rotation=90)
    ax.set_xlim(-0.6, len(keys) - 0.4)
    ax.grid(alpha=0.3, axis="y")


def null_bands(ax, x: list[float], points: list[Point], color: str, name: str, per_site: bool = True) -> None:
    """The null a mean angle is compared with: mean +- sd of the mean angle to random directions where measured
    (a band), else dashed lines at 90 +- the sd of ONE random vector's angle (what the error bars compare with).
    per_site: x are site ticks, each covered to half-way to its neighbours; else x are steps, joined."""
    if per_site:
        x = [edge for tick in x for edge in (tick - 0.5, tick + 0.5)]
        points = [p for p in points for _ in range(2)]
    drawstyle = "default" if per_site else "steps-mid"
    if all(p.random_sd is not None for p in points):
        ax.fill_between(x, [p.random_mean - p.random_sd for p in points], [p.random_mean + p.random_sd for p in points],
                        step=None if per_site else "mid", color=color, alpha=0.15, lw=0,
                        label=f"null{' ' + name if name else ''}: mean angle to random directions ± 1 sd")
    else:
        for sign in (1, -1):
            ax.plot(x, [90 + sign * p.single_sd for p in points], ls="--", lw=0.7, color="grey", drawstyle=drawstyle,
                    label="null: ONE random vector's angle, 90 ± (180/π)/√d (compare with the error bars)")


def legend_below(fig, axes) -> None:
    """One legend below the panels: each series and null once."""
    entries = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    fig.legend(entries.values(), entries.keys(), loc="outside lower center", ncols=min(2, len(entries)))


def plot_angles_by_layer(title: str, series: list[AngleSeries], out: Path, name: str) -> str | None:
    """The paper's per-layer figure at a checkpoint: the angle to 1 at the norms' inputs and outputs, every norm
    overlaid (seed means; error bars: the std over tokens)."""
    norms = [s.norm for s in series]
    profiles = {(s.norm, io): profile(s.angles, io, "uniform") for s in series for io in ("input", "output")}
    keys = sorted({k for p in profiles.values() for k in p}, key=site_sort)
    if not keys:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(7.2, 3.8), sharey=True, layout="constrained")
    for ax, (io, io_label) in zip(axes, (("input", "norm inputs"), ("output", "norm outputs (affine included)"))):
        for s, dx in zip(series, offsets(len(series))):
            points = profiles[(s.norm, io)]
            xs = [keys.index(k) for k in points]
            null_bands(ax, xs, list(points.values()), norm_color(s.norm, norms), s.norm)
            ax.errorbar([x + dx for x in xs], [p.mean for p in points.values()],
                        yerr=[p.token_sd for p in points.values()], fmt=NORM_MARKERS.get(s.norm, "o"), ms=3,
                        capsize=1.5, lw=0.8, color=norm_color(s.norm, norms),
                        label=f"{s.norm} ({runs_text(len(s.angles))})")
        ax.set_title(f"angle to 1 at the {io_label}")
        site_axis(ax, keys)
    axes[0].set_ylabel("angle (degrees): mean, ± std over tokens")
    legend_below(fig, axes)
    fig.suptitle(f"{title}: step {step_text(profiles.values())}")
    return save(fig, out, name)
