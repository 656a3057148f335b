"""The per-layer angle figure (the angle to 1 at the norms' inputs and outputs, every norm overlaid, with each run's
mean beside the runs' mean and the null each mean angle is compared with) and the drawing conventions the report's
other figures share: a colour and marker per norm (norm_styles), markers per seed, one tick per norm site, one null
band per set of norms whose nulls coincide, one legend below the panels and inside the canvas, titles that name the
step, PDF and PNG at print resolution.
Training's angle callback draws the per-layer figure for each probe, the report for each group of runs and pretrained
model."""

import functools
import hashlib
import logging
import re
import textwrap
import warnings
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
# Two norms' nulls whose band edges differ by at most this many null sds (of the narrower) are drawn as one band (their
# envelope): no point's distance from the band, in null sds, moves by more than that
NULL_MATCH = 0.25
LEGEND_MARGIN = 0.98  # of the figure's width: a legend never touches the canvas's edges
SHORTEST_WRAP = 20  # characters: a legend's label is wrapped no narrower (then its columns are fewer)


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


@dataclass
class Null:
    """One series' null in a panel: the points (of its angle profile) at x, which hold the null's values."""
    x: list[float]
    points: list[Point]
    norm: str = ""  # named in the band's label where the band is not every series'
    color: str = "grey"

    @property
    def measured(self) -> bool:
        """Whether angles.csv measured the null over random directions at every x."""
        return all(p.random_sd is not None for p in self.points)


def same_null(a: Null, b: Null) -> bool:
    """Whether two measured nulls are one on the page: at every x, band edges within NULL_MATCH null sds."""
    return a.x == b.x and all(abs(p.random_mean - q.random_mean) + abs(p.random_sd - q.random_sd)
                              <= NULL_MATCH * min(p.random_sd, q.random_sd) for p, q in zip(a.points, b.points))


def null_bands(ax, nulls: list[Null], per_site: bool = True) -> None:
    """The null a mean angle is compared with, each drawn once: mean +- sd of the mean angle to random directions
    where measured, one light unhatched band per set of series whose nulls coincide (same_null; the null depends on
    the directions and the token distribution, nearly the same for norms that learned alike), so that a handful of
    bands never overlap into a pattern; else dashed lines at 90 +- the sd of ONE random vector's angle (what the
    error bars compare with). per_site: x are site ticks, each covered to half-way to its neighbours; else x are
    steps, joined."""
    nulls = [null for null in nulls if null.points]
    measured = [null for null in nulls if null.measured]
    sets: list[list[Null]] = []
    for null in measured:
        alike = next((members for members in sets if all(same_null(null, m) for m in members)), None)
        if alike is None:
            sets.append([null])
        else:
            alike.append(null)
    for members in sets:
        x, points = members[0].x, list(zip(*(m.points for m in members)))
        lows = [min(p.random_mean - p.random_sd for p in at) for at in points]
        highs = [max(p.random_mean + p.random_sd for p in at) for at in points]
        whose = ("" if len(nulls) == 1 else " of every norm" if len(members) == len(nulls)
                 else f" of {', '.join(m.norm for m in members)}")
        color = members[0].color if len(members) == 1 else "grey"
        ax.fill_between(*per_site_edges(x, lows, highs, per_site), step=None if per_site else "mid",
                        facecolor=to_rgba(color, 0.12), edgecolor=to_rgba(color, 0.6), lw=0.5,
                        label=f"null{whose}: mean angle to random directions ± 1 sd (for the runs' mean)")
    drawn = set()
    for null in [n for n in nulls if not n.measured]:
        singles = tuple(p.single_sd for p in null.points)
        if (tuple(null.x), singles) in drawn:  # the same d: the same lines
            continue
        drawn.add((tuple(null.x), singles))
        x, lows, highs = per_site_edges(null.x, [90 - sd for sd in singles], [90 + sd for sd in singles], per_site)
        for edge in (lows, highs):
            ax.plot(x, edge, ls="--", lw=0.7, color="grey", drawstyle="default" if per_site else "steps-mid",
                    label="null: ONE random vector's angle, 90 ± (180/π)/√d (compare with the error bars)")


def per_site_edges(x: list[float], lows: list[float], highs: list[float], per_site: bool) -> tuple[list, list, list]:
    """x, lows and highs to draw: per site, each value held from half-way to the previous tick to half-way to the
    next; else as given (steps)."""
    if not per_site:
        return x, lows, highs
    edges = [edge for tick in x for edge in (tick - 0.5, tick + 0.5)]
    return edges, [low for low in lows for _ in range(2)], [high for high in highs for _ in range(2)]


def wrap_label(label: str, width: int) -> str:
    return "\n".join(textwrap.fill(line, width) for line in label.splitlines())


def fit_labels(fig) -> None:
    """Each panel's title and y label wrapped narrower, their lines kept, until the title is no wider than its panel
    (else it runs into the next panel's, or off the canvas) and the y label, which is rotated, no taller than it
    (else it runs into the titles above, or the layout gives up). The width a text needs is in proportion to its
    panel's size; a few layouts settle it."""
    texts = [(ax, kind, text) for ax in fig.axes if ax.get_visible()
             for kind, text in (("title", ax.get_title()), ("ylabel", ax.get_ylabel())) if text]
    widths = {(ax, kind): max(map(len, text.splitlines())) for ax, kind, text in texts}
    for _ in range(6):  # each layout moves the panels a little: until nothing changes
        with warnings.catch_warnings():  # a label too tall for its panel collapses the layout until it is fitted
            warnings.filterwarnings("ignore", "constrained_layout not applied")
            fig.canvas.draw()
        changed = False
        for ax, kind, text in texts:
            panel = ax.get_window_extent()
            drawn = (ax.title if kind == "title" else ax.yaxis.label).get_window_extent()
            fits = 0.97 * (panel.width / drawn.width if kind == "title" else panel.height / drawn.height)
            if fits < 1 and widths[ax, kind] > SHORTEST_WRAP:
                widths[ax, kind] = max(SHORTEST_WRAP, min(widths[ax, kind] - 1, int(widths[ax, kind] * fits)))
                (ax.set_title if kind == "title" else ax.set_ylabel)(wrap_label(text, widths[ax, kind]))
                changed = True
        if not changed:
            return


def finish(fig, axes, title: str, ncols: int = 2) -> None:
    """A figure's title, its panels' titles and y labels fitted (fit_labels) and its one legend (legend_below), in
    this order: the title takes height from the panels, and the legend adds its own."""
    fit_title(fig, title)
    fit_labels(fig)
    legend_below(fig, axes, ncols)


def fit_title(fig, title: str) -> None:
    """The figure's title, its lines wrapped narrower until it is no wider than the canvas (a narrow figure of two
    comparisons has less room than its title's one line asks for), and the figure taller by the lines it gained, so
    that the panels keep the height the caller gave them."""
    width = max(map(len, title.splitlines()))
    text = fig.suptitle(title)
    renderer = fig.canvas.get_renderer()
    first = drawn = text.get_window_extent(renderer)
    while width > SHORTEST_WRAP and (fits := 0.97 * fig.bbox.width / drawn.width) < 1:
        width = max(SHORTEST_WRAP, min(width - 1, int(width * fits)))
        text.set_text(wrap_label(title, width))
        drawn = text.get_window_extent(renderer)
    fig.set_figheight(fig.get_figheight() + (drawn.height - first.height) / fig.dpi)


def legend_below(fig, axes, ncols: int = 2) -> None:
    """One legend below the panels, each series and null once, inside the canvas: its labels wrapped (then its
    columns fewer) until it is narrower than the figure, and the figure taller by the legend's height, so that the
    panels keep the height the caller gave them."""
    entries = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if not entries:
        return
    renderer = fig.canvas.get_renderer()
    longest = max(len(line) for label in entries for line in label.splitlines())
    widths = list(range(longest, SHORTEST_WRAP - 1, -4)) or [longest]  # characters a label's line may hold
    for columns in range(min(ncols, len(entries)), 0, -1):
        for width in widths:
            legend = fig.legend(entries.values(), [wrap_label(label, width) for label in entries],
                                loc="outside lower center", ncols=columns)
            extent = legend.get_window_extent(renderer)
            if extent.width <= LEGEND_MARGIN * fig.bbox.width or (columns == 1 and width == widths[-1]):
                fig.set_figheight(fig.get_figheight() + extent.height / fig.dpi)
                return
            legend.remove()


def angles_by_layer_figure(title: str, series: list[AngleSeries]) -> Figure | None:
    """The paper's per-layer figure at a checkpoint: the angle to 1 at the norms' inputs and outputs, every norm
    overlaid: the runs' mean (error bars: the std over tokens, averaged over the runs) and, for several runs, each
    run's own mean beside it (small open markers: the spread across seeds); None without angle rows."""
    styles = norm_styles(series)
    profiles = {(s.norm, io): profile(s.angles, io, "uniform") for s in series for io in ("input", "output")}
    keys = sorted({k for p in profiles.values() for k in p}, key=site_sort)
    if not keys:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(7.2, 3.0), sharey=True, layout="constrained")
    beside = 0.4 * slot_width(len(series))  # each run's mean, right of the runs' mean
    for ax, (io, io_label) in zip(axes, (("input", "norm inputs"), ("output", "norm outputs\n(affine included)"))):
        null_bands(ax, [Null([keys.index(k) for k in profiles[(s.norm, io)]], list(profiles[(s.norm, io)].values()),
                             s.norm, styles[s.norm].color) for s in series])
        for s, dx in zip(series, offsets(len(series))):
            points, color, marker = profiles[(s.norm, io)], styles[s.norm].color, styles[s.norm].marker
            xs = [keys.index(k) for k in points]
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
    axes[0].set_ylabel("angle to 1 (degrees)\nmean, bars ± std over tokens")
    steps = {s for p in profiles.values() for point in p.values() for s in point.steps}
    finish(fig, axes, f"{title}: {steps_title(steps)}")
    return fig


def plot_angles_by_layer(title: str, series: list[AngleSeries], out: Path, name: str) -> str | None:
    """The per-layer figure (angles_by_layer_figure) as `name`.pdf and .png in `out`: the PNG's name."""
    return save(angles_by_layer_figure(title, series), out, name)
