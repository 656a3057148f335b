"""The per-layer angle figure (the angle to 1 at the norms' inputs and outputs, every norm overlaid, with each run's
mean beside the runs' mean and the null each mean angle is compared with) and the drawing conventions the report's
other figures share: colours per norm, markers per norm or per seed, one tick per norm site, null bands that never
blend, one legend below the panels, titles that name the step, PDF and PNG at print resolution. Training's angle
callback draws the per-layer figure for each probe, the report for each group of runs and pretrained model."""

import logging
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

from normlab.probe.profiles import Point, profile, runs_text, site_sort, site_tick

matplotlib.use("Agg")  # files only, no display (no figure exists yet, so switching after pyplot's import is allowed)
logging.getLogger("fontTools").setLevel(logging.WARNING)  # its font subsetting for the PDF files says every step

DPI = 300  # print resolution of the PNG files (the PDF files are vector graphics)
NORM_COLORS = {"layernorm": "tab:blue", "rmsnorm": "tab:red", "layernorm_nobias": "tab:purple",
               "rmsnorm_bias": "tab:orange", "dyt": "tab:green"}
OTHER_COLORS = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")  # none of NORM_COLORS'
NORM_MARKERS = {"layernorm": "o", "rmsnorm": "s", "layernorm_nobias": "^", "rmsnorm_bias": "D", "dyt": "v"}
SEED_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">")  # the k-th seed of a norm
SEED_LINES = ("-", "--", ":", "-.")
HATCHES = ("////", "\\\\\\\\", "||||", "----")  # the k-th norm's null band: crossing, never one blended colour


@dataclass
class AngleSeries:
    """What one norm contributes to an angle figure: the angle rows of its runs (seeds), or of one pretrained
    model."""
    norm: str
    angles: list[list[dict]]  # per run


def norm_color(norm: str, norms: list[str]) -> str:
    return NORM_COLORS.get(norm) or OTHER_COLORS[norms.index(norm) % len(OTHER_COLORS)]


def save(fig: Figure | None, out: Path, name: str) -> str | None:
    """`name`.pdf and `name`.png in `out`: the PNG's file name (None, and nothing written, for no figure)."""
    if fig is None:
        return None
    fig.savefig(out / f"{name}.pdf", dpi=DPI)
    fig.savefig(out / f"{name}.png", dpi=DPI)
    plt.close(fig)
    return f"{name}.png"


def steps_title(steps) -> str:
    """"step 1,000", "steps 800, 1,000", or "step not recorded": what a title says of the steps it shows."""
    steps = sorted({s for s in steps if s is not None})
    if not steps:
        return "step not recorded"
    return f"step{'s' * (len(steps) > 1)} " + ", ".join(f"{s:,}" for s in steps)


def slot_width(count: int) -> float:
    return min(0.8 / count, 0.18)


def offsets(count: int) -> list[float]:
    """x offsets of `count` series around a tick, so that error bars never cover each other."""
    return [(k - (count - 1) / 2) * slot_width(count) for k in range(count)]


def site_axis(ax, keys: list[tuple]) -> None:
    ax.set_xticks(range(len(keys)), [site_tick(k) for k in keys], rotation=90)
    ax.set_xlim(-0.6, len(keys) - 0.4)
    ax.grid(alpha=0.3, axis="y")


def null_bands(ax, x: list[float], points: list[Point], color: str, name: str, per_site: bool = True,
               hatch: str = HATCHES[0]) -> None:
    """The null a mean angle is compared with: mean +- sd of the mean angle to random directions where measured
    (a band, hatched in `color` and unfilled, so that the bands of several norms cross rather than blend into a
    colour of their own), else dashed lines at 90 +- the sd of ONE random vector's angle (what the error bars
    compare with). per_site: x are site ticks, each covered to half-way to its neighbours; else x are steps, joined."""
    if per_site:
        x = [edge for tick in x for edge in (tick - 0.5, tick + 0.5)]
        points = [p for p in points for _ in range(2)]
    drawstyle = "default" if per_site else "steps-mid"
    if all(p.random_sd is not None for p in points):
        ax.fill_between(x, [p.random_mean - p.random_sd for p in points], [p.random_mean + p.random_sd for p in points],
                        step=None if per_site else "mid", facecolor="none", edgecolor=to_rgba(color, 0.6),
                        hatch=hatch, lw=0.4, label=f"null{' ' + name if name else ''}: mean angle to random "
                                                   "directions ± 1 sd (hatched; for the runs' mean)")
    else:
        for sign in (1, -1):
            ax.plot(x, [90 + sign * p.single_sd for p in points], ls="--", lw=0.7, color="grey", drawstyle=drawstyle,
                    label="null: ONE random vector's angle, 90 ± (180/π)/√d (compare with the error bars)")


def legend_below(fig, axes, ncols: int = 2) -> None:
    """One legend below the panels: each series and null once."""
    entries = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    fig.legend(entries.values(), entries.keys(), loc="outside lower center", ncols=min(ncols, len(entries)))


def angles_by_layer_figure(title: str, series: list[AngleSeries]) -> Figure | None:
    """The paper's per-layer figure at a checkpoint: the angle to 1 at the norms' inputs and outputs, every norm
    overlaid: the runs' mean (error bars: the std over tokens, averaged over the runs) and, for several runs, each
    run's own mean beside it (small open markers: the spread across seeds); None without angle rows."""
    norms = [s.norm for s in series]
    profiles = {(s.norm, io): profile(s.angles, io, "uniform") for s in series for io in ("input", "output")}
    keys = sorted({k for p in profiles.values() for k in p}, key=site_sort)
    if not keys:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(7.2, 3.8), sharey=True, layout="constrained")
    beside = 0.4 * slot_width(len(series))  # each run's mean, right of the runs' mean
    for ax, (io, io_label) in zip(axes, (("input", "norm inputs"), ("output", "norm outputs (affine included)"))):
        for i, (s, dx) in enumerate(zip(series, offsets(len(series)))):
            points, color = profiles[(s.norm, io)], norm_color(s.norm, norms)
            xs = [keys.index(k) for k in points]
            null_bands(ax, xs, list(points.values()), color, s.norm, hatch=HATCHES[i % len(HATCHES)])
            ax.errorbar([x + dx for x in xs], [p.mean for p in points.values()],
                        yerr=[p.token_sd for p in points.values()], fmt=NORM_MARKERS.get(s.norm, "o"), ms=3,
                        capsize=1.5, lw=0.8, color=color,
                        label=f"{s.norm}: mean of {runs_text(len(s.angles))}, bars ± std over tokens")
            if len(s.angles) > 1:
                per_run = [profile([rows], io, "uniform") for rows in s.angles]
                runs = [(keys.index(k) + dx + beside, p.mean) for run in per_run for k, p in run.items()]
                ax.plot(*zip(*runs), NORM_MARKERS.get(s.norm, "o"), ms=2.2, mfc="none", mew=0.6, ls="none",
                        color=color, label=f"{s.norm}: each run's (seed's) mean")
        ax.set_title(f"angle to 1 at the {io_label}")
        site_axis(ax, keys)
    axes[0].set_ylabel("angle (degrees): mean, bars ± std over tokens")
    legend_below(fig, axes)
    steps = {s for p in profiles.values() for point in p.values() for s in point.steps}
    fig.suptitle(f"{title}: {steps_title(steps)}")
    return fig


def plot_angles_by_layer(title: str, series: list[AngleSeries], out: Path, name: str) -> str | None:
    """The per-layer figure (angles_by_layer_figure) as `name`.pdf and .png in `out`: the PNG's name."""
    return save(angles_by_layer_figure(title, series), out, name)
