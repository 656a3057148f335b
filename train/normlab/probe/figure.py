"""The per-layer angle figure (the angle to 1 at the norms' inputs and outputs, every norm overlaid, with each run's
mean beside the runs' mean and the null each mean angle is compared with) and the drawing conventions the report's
other figures share: a colour and marker per norm (norm_styles), markers per seed, one tick per norm site, null
bands that never blend, one legend below the panels, titles that name the step, PDF and PNG at print resolution.
Training's angle callback draws the per-layer figure for each probe, the report for each group of runs and pretrained
model."""

import functools
import hashlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.colors import is_color_like, to_rgba
from matplotlib.figure import Figure
from matplotlib.markers import MarkerStyle
from omegaconf import OmegaConf

from normlab.common.paths import CONF_DIR
from normlab.probe.profiles import Point, profile, runs_text, site_sort, site_tick

matplotlib.use("Agg")  # files only, no display (no figure exists yet, so switching after pyplot's import is allowed)
logging.getLogger("fontTools").setLevel(logging.WARNING)  # its font subsetting for the PDF files says every step

DPI = 300  # print resolution of the PNG files (the PDF files are vector graphics)
# A norm without a style of its own draws from these (none is one that conf/norm/*.yaml gives a norm)
PALETTE = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray", "navy", "teal", "goldenrod")
MARKERS = ("P", "X", "h", "*", "p", "<", ">", "d")
SEED_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">")  # the k-th seed of a norm
SEED_LINES = ("-", "--", ":", "-.")
HATCHES = ("////", "\\\\\\\\", "||||", "----")  # the k-th norm's null band: crossing, never one blended colour


@dataclass
class AngleSeries:
    """What one norm contributes to an angle figure: the angle rows of its runs (seeds), or of one pretrained
    model."""
    norm: str
    angles: list[list[dict]]  # per run
    style: dict | None = field(default=None, kw_only=True)  # the norm's `style` of its config (color, marker)


@dataclass(frozen=True)
class Style:
    color: str
    marker: str


@functools.cache
def configured_style(norm: str) -> dict:
    """The `style` of conf/norm/<norm>.yaml, for a norm whose own config does not give one (a run written before
    styles, a pretrained model's CSV, training's angle figure): {} where there is none."""
    path = CONF_DIR / "norm" / f"{norm}.yaml"
    if not re.fullmatch(r"[\w.-]+", norm) or not path.is_file():
        return {}
    return OmegaConf.to_container(OmegaConf.load(path)).get("style") or {}


def known_marker(marker) -> bool:
    """Whether matplotlib draws `marker` (None, which it takes for no marker, is none given)."""
    try:
        MarkerStyle(marker)
    except (ValueError, TypeError):
        return False
    return marker is not None


def preference(norm: str, options: tuple, what: str) -> list:
    """`options` from a place that a hash of the norm's name picks: the same order in every figure and report."""
    start = int(hashlib.sha256(f"{what} {norm}".encode()).hexdigest(), 16) % len(options)
    return list(options[start:] + options[:start])


def norm_styles(series: list[AngleSeries]) -> dict[str, Style]:
    """The colour and marker of each norm of a figure: the ones its config gives (norm.style, which the run's
    config.yaml records; else conf/norm/<name>.yaml's), else the first of PALETTE and MARKERS in an order drawn from
    its name; either way the first that no other norm of the figure holds (norms with a style first, then by name),
    so that a norm keeps its style in every figure and two norms of one figure never share one."""
    given = {s.norm: s.style or configured_style(s.norm) for s in series}
    styles, colors, markers = {}, set(), set()
    for norm in sorted(given, key=lambda n: (not given[n], n)):
        own_color, own_marker = given[norm].get("color"), given[norm].get("marker")
        color_choices = ([own_color] if is_color_like(own_color) else []) + preference(norm, PALETTE, "color")
        marker_choices = ([own_marker] if known_marker(own_marker) else []) + preference(norm, MARKERS, "marker")
        color = next((c for c in color_choices if c not in colors), color_choices[0])
        marker = next((m for m in marker_choices if m not in markers), marker_choices[0])
        styles[norm] = Style(color, marker)
        colors.add(color)
        markers.add(marker)
    return styles


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
    styles = norm_styles(series)
    profiles = {(s.norm, io): profile(s.angles, io, "uniform") for s in series for io in ("input", "output")}
    keys = sorted({k for p in profiles.values() for k in p}, key=site_sort)
    if not keys:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(7.2, 3.8), sharey=True, layout="constrained")
    beside = 0.4 * slot_width(len(series))  # each run's mean, right of the runs' mean
    for ax, (io, io_label) in zip(axes, (("input", "norm inputs"), ("output", "norm outputs (affine included)"))):
        for i, (s, dx) in enumerate(zip(series, offsets(len(series)))):
            points, color, marker = profiles[(s.norm, io)], styles[s.norm].color, styles[s.norm].marker
            xs = [keys.index(k) for k in points]
            null_bands(ax, xs, list(points.values()), color, s.norm, hatch=HATCHES[i % len(HATCHES)])
            ax.errorbar([x + dx for x in xs], [p.mean for p in points.values()],
                        yerr=[p.token_sd for p in points.values()], marker=marker, ls="none", ms=3,
                        capsize=1.5, lw=0.8, color=color,
                        label=f"{s.norm}: mean of {runs_text(len(s.angles))}, bars ± std over tokens")
            if len(s.angles) > 1:
                per_run = [profile([rows], io, "uniform") for rows in s.angles]
                runs = [(keys.index(k) + dx + beside, p.mean) for run in per_run for k, p in run.items()]
                ax.plot(*zip(*runs), marker=marker, ms=2.2, mfc="none", mew=0.6, ls="none",
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
