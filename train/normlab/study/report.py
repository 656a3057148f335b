"""normlab-report runs=[RUN_OR_SWEEP_DIR,...] csvs=[HF_ANGLES.csv,...]: the answer of a set of runs to "does
LayerNorm's mean subtraction do any work?", as tables (summary.md) and figures (PDF and PNG, 300 dpi).

Runs are grouped by their whole resolved config less what does not shape the comparison (the seed, the norm
variant, names, paths, loggers, devices: `comparison_settings`); within a group, a run with a centred norm
(LayerNorm) and one without (RMSNorm) of the same bias setting and seed form a pair (same initial weights, same
batches), and the paired differences of their final validation loss give a t-based 95% confidence interval.
Unfinished runs and replicates are shown and flagged, never compared; `.replaced-*` folders (restart=true) are
skipped. Angles come from each run's angles.csv at its last measured step, ablations from its ablation.csv
(normlab-ablate). Pretrained models enter as the CSVs of normlab-angles (and normlab-ablate). docs/report.md says
how to read every table and figure.
"""

import hashlib
import json
import logging
import math
import os
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter
from omegaconf import DictConfig, OmegaConf

from normlab.common import outputs
from normlab.common.paths import identifies_the_run
from normlab.study.angles import REFERENCES, AnalysisError, DamagedTable, read_rows
from normlab.training.run_dir import flat

matplotlib.use("Agg")  # files only, no display (no figure exists yet, so switching after pyplot's import is allowed)
logging.getLogger("fontTools").setLevel(logging.WARNING)  # its font subsetting for the PDF files says every step

COMMAND = "normlab-report"
DPI = 300  # print resolution of the PNG files (the PDF files are vector graphics)
DEMO_MODELS = ("tiny",)
DEMO_NOTE = "demo scale: not evidence about the paper's models"
NORM_COLORS = {"layernorm": "tab:blue", "rmsnorm": "tab:red", "layernorm_nobias": "tab:purple",
               "rmsnorm_bias": "tab:orange"}
OTHER_COLORS = ("tab:green", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")
NORM_MARKERS = {"layernorm": "o", "rmsnorm": "s", "layernorm_nobias": "^", "rmsnorm_bias": "D"}
REFERENCE_LABELS = {"uniform": "uniform vector 1", "random_a": "random a~ (norm √d)",
                    "random_b": "random b~ (norm √d/2)"}
REFERENCE_MARKERS = {"uniform": "o", "random_a": "s", "random_b": "^"}
REFERENCE_COLORS = {"uniform": "tab:green", "random_a": "tab:purple", "random_b": "tab:orange"}
ROLE_ORDER = {"attn_norm": 0, "mlp_norm": 1, "final_norm": 2}
ROLE_TICKS = {"attn_norm": "attn", "mlp_norm": "MLP"}
STYLE = {"font.size": 8, "axes.titlesize": 8, "legend.fontsize": 6.5, "axes.labelsize": 8, "pdf.fonttype": 42}

# The 0.975 quantile of Student's t for 1..30 degrees of freedom (beyond: Hill's expansion, t_quantile_975)
T_975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604,
         2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
         2.0518, 2.0484, 2.0452, 2.0423)
Z_975 = 1.959963984540054


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t: the table to 30 degrees of freedom, then the Cornish-Fisher expansion
    about the normal quantile (G. W. Hill 1970; within 1e-7 of the exact value from 30 on)."""
    if df <= len(T_975):
        return T_975[df - 1]
    z = Z_975
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


@dataclass(frozen=True)
class Interval:
    """The mean of paired differences with its t-based 95% confidence interval (None for a single pair)."""
    n: int
    mean: float
    sd: float | None
    low: float | None
    high: float | None

    @classmethod
    def of(cls, values: list[float]) -> "Interval":
        mean = statistics.fmean(values)
        if len(values) < 2:
            return cls(len(values), mean, None, None, None)
        sd = statistics.stdev(values)
        half = t_quantile_975(len(values) - 1) * sd / math.sqrt(len(values))
        return cls(len(values), mean, sd, mean - half, mean + half)

    @property
    def excludes_zero(self) -> bool | None:
        return None if self.low is None else self.low > 0 or self.high < 0

    def text(self) -> str:
        if self.low is None:
            return f"{self.mean:+.4f} (1 pair: no interval)"
        return f"{self.mean:+.4f} [{self.low:+.4f}, {self.high:+.4f}]"


# -- reading: run directories, angles and ablation CSVs


@dataclass(frozen=True)
class Variant:
    """A norm as the comparison sees it: centred (removes the component along 1: LayerNorm) or not, with a bias
    or without."""
    name: str
    centred: bool
    bias: bool

    @property
    def order(self) -> tuple:
        return (not self.bias, not self.centred, self.name)  # layernorm, rmsnorm_bias, layernorm_nobias, rmsnorm


def norm_variant(norm: dict) -> Variant:
    """From config.yaml's `norm`: its `centred` and `bias` keys, or (configs before them) inferred from the name:
    layernorm centred with a bias, rmsnorm neither, a `_bias`/`_nobias` suffix setting the bias."""
    name = str(norm["name"])
    centred = norm.get("centred", name.startswith("layernorm"))
    named_bias = False if name.endswith("_nobias") else True if name.endswith("_bias") else centred
    return Variant(name, bool(centred), bool(norm.get("bias", named_bias)))


INT_COLUMNS = {"step", "layer", "count", "d", "seed", "windows", "tokens", "null_directions"}
FLOAT_COLUMNS = {"mean_deg", "std_deg", "min_deg", "max_deg", "mean_norm", "mean_cos2", "null_mean_deg", "null_std_deg",
                 "sem_deg", "null_percentile", "null_random_mean_deg", "null_random_std_deg", "loss", "ablated_loss",
                 "delta", "ci_low", "ci_high", "share_along_1", "value", "stderr"}
ANGLE_COLUMNS = ("step", "layer", "site", "reference", "position", "count", "mean_deg", "std_deg", "mean_cos2",
                 "null_std_deg", "d")  # what the report needs of an angles CSV; any other column is optional
ABLATION_COLUMNS = ("site", "delta")
EVAL_COLUMNS = ("step", "task", "metric", "value")


def table_value(column: str, value: str) -> int | float | str | None:
    """A value of an angles or ablation CSV, read by its column's name: numbers where the report computes with
    them (empty: None), any other column as its text."""
    if column in INT_COLUMNS:
        return int(float(value)) if value else None
    if column in FLOAT_COLUMNS:
        return float(value) if value else None
    return value


def metric_value(column: str, value: str) -> int | float | None:
    """A value of metrics.csv: the step, or a metric (None where the row does not log it)."""
    return int(value) if column == "step" else float(value) if value else None


RUN_CONFIG_KEYS = ("model.name", "norm.name", "seed")  # what the report needs of a run's config.yaml


def read_config(path: Path) -> dict:
    try:
        config = OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 (yaml's and OmegaConf's errors alike)
        mark = getattr(e, "problem_mark", None)  # where yaml found the problem
        problem = f"line {mark.line + 1}: {e.problem}" if mark else str(e).strip().splitlines()[0]
        raise AnalysisError(
            f"{path} is not valid YAML ({problem}): restore it, or leave this run out of the report"
        ) from None
    missing = [k for k in RUN_CONFIG_KEYS if not isinstance(config, DictConfig) or OmegaConf.select(config, k) is None]
    if missing:
        raise AnalysisError(
            f"{path} is not a normlab run config (no {', '.join(missing)}): restore it, or leave this "
            "run out of the report"
        )
    return OmegaConf.to_container(config)


def read_angles(path: Path, remedy: str) -> list[dict]:
    try:
        return read_rows(path, table_value, ANGLE_COLUMNS)
    except DamagedTable as e:
        raise AnalysisError(f"{e}: {remedy}") from None


def read_evaluation(path: Path) -> list[dict]:
    try:
        return read_rows(path, table_value, EVAL_COLUMNS)
    except DamagedTable as e:
        raise AnalysisError(f"{e}: move it aside and evaluate the run again with normlab-eval") from None


def read_ablation(path: Path) -> list[dict]:
    try:
        return read_rows(path, table_value, ABLATION_COLUMNS)
    except DamagedTable as e:
        raise AnalysisError(f"{e}: write it again with normlab-ablate") from None


@dataclass
class Run:
    dir: Path
    name: str  # the run directory, relative to the folder the report's runs share
    config: dict
    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    angles: list[dict] = field(default_factory=list)
    ablation: list[dict] = field(default_factory=list)
    evaluation: list[dict] = field(default_factory=list)  # eval/results.csv of normlab-eval
    left_out: str = ""  # why the run is not compared ("": it is)
    note: str = ""  # what else the runs table says of it

    @property
    def model(self) -> str:
        return str(self.config["model"]["name"])

    @property
    def variant(self) -> Variant:
        return norm_variant(self.config["norm"])

    @property
    def seed(self) -> int:
        return self.config["seed"]

    @property
    def pairing(self) -> tuple:
        """Runs of one group with equal pairing start from the same weights and see the same batches."""
        return self.seed, (self.config.get("data") or {}).get("seed", self.seed)

    @property
    def max_steps(self) -> int | None:
        steps = (self.config.get("trainer") or {}).get("max_steps")
        return steps if isinstance(steps, int) and steps > 0 else None

    @property
    def val_step(self) -> int | None:
        """Optimizer steps done at the last validation (metrics.csv logs a validation at the index of the step
        before it: 399 for the one after 400 steps)."""
        return self.metrics["val/loss"][-1][0] + 1 if self.metrics.get("val/loss") else None

    @property
    def final_val_loss(self) -> float:
        return self.metrics["val/loss"][-1][1] if self.metrics.get("val/loss") else math.nan

    @property
    def unfinished(self) -> str:
        """Why the run has not finished ('' when it has)."""
        if self.val_step is None:
            return "unfinished: no validation yet"
        if self.max_steps is not None and self.val_step < self.max_steps:
            return f"unfinished: step {self.val_step:,} of {self.max_steps:,}"
        return ""


def load_run(run_dir: Path, name: str) -> Run:
    run = Run(run_dir, name, read_config(run_dir / "config.yaml"))
    try:
        rows = read_rows(run_dir / "metrics.csv", metric_value)
    except DamagedTable as e:
        raise AnalysisError(f"{e}: rerun the same normlab-train command, which repairs it") from None
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "epoch") and value is not None:
                run.metrics.setdefault(key, []).append((row["step"], value))
    for values in run.metrics.values():
        values.sort(key=lambda item: item[0])
    if (run_dir / "angles.csv").is_file():
        run.angles = read_angles(
            run_dir / "angles.csv",
            f"rerun the same normlab-train command, which repairs it, or regenerate it with normlab-angles "
            f"model_path={run_dir} out={run_dir / 'angles.csv'}",
        )
    if (run_dir / "ablation.csv").is_file():
        run.ablation = read_ablation(run_dir / "ablation.csv")
    if (run_dir / "eval" / "results.csv").is_file():
        run.evaluation = read_evaluation(run_dir / "eval" / "results.csv")
    return run


def find_runs(paths: list[Path]) -> tuple[list[Run], list[Path]]:
    """The runs (metrics.csv + config.yaml) at or under `paths`, and the `.replaced-*` folders skipped there."""
    dirs, replaced = set(), set()
    for root in paths:
        for metrics in root.rglob("metrics.csv"):
            parts = metrics.parent.relative_to(root).parts
            aside = [i for i, part in enumerate(parts) if ".replaced-" in part]
            if aside:
                replaced.add(root.joinpath(*parts[: aside[0] + 1]))
            elif (metrics.parent / "config.yaml").is_file():
                dirs.add(metrics.parent)
    dirs = sorted(dirs)
    common = Path(os.path.commonpath([d.resolve() for d in dirs])) if len(dirs) > 1 else None
    runs = [load_run(d, str(d.resolve().relative_to(common)) if common else d.resolve().name) for d in dirs]
    return runs, sorted(replaced)


# -- groups, pairs and the paired comparison

VARIANT_KEYS = ("name", "centred", "bias", "_target_")  # below norm: what tells the variants apart
PAIRING_KEYS = ("seed", "data.seed")


def comparison_settings(config: dict) -> dict:
    """What shapes a run's result besides its norm variant and seed: the resolved config less the settings that
    only name, place, log or speed up a run (paths.NOT_IDENTITY: experiment and run names, paths, loggers, devices,
    ...), less seed and norm; paths inside the run directory are written <run_dir>, and the sequences an optimizer
    step sees stand for the devices. A model size or learning rate of its own makes a group of its own."""
    run_dir = str(config.get("run_dir") or "\0")
    settings = {}
    for key, value in flat(config).items():
        if not identifies_the_run(key) or key in PAIRING_KEYS:
            continue
        if key.startswith("norm.") and key.rsplit(".", 1)[-1] in VARIANT_KEYS:
            continue
        settings[key] = value.replace(run_dir, "<run_dir>") if isinstance(value, str) else value
    trainer, data = config.get("trainer") or {}, config.get("data") or {}
    devices = [trainer.get(k) if isinstance(trainer.get(k), int) else 1 for k in ("devices", "num_nodes")]
    settings["sequences per optimizer step"] = config.get("global_batch_size") or (
        (data.get("batch_size") or 0) * devices[0] * devices[1])
    return settings


@dataclass
class Comparison:
    """Uncentred minus centred (RMS - LN) final validation loss, paired by seed, for one bias setting."""
    bias: bool | None  # None: the two norms differ in the bias too
    centred: str  # the norm names
    uncentred: str
    pairs: list[tuple[Run, Run]]  # (centred, uncentred)

    @property
    def label(self) -> str:
        bias = "the bias differs too" if self.bias is None else "with bias" if self.bias else "without bias"
        return f"{self.uncentred} − {self.centred} ({bias})"

    @property
    def differences(self) -> list[float]:
        return [u.final_val_loss - c.final_val_loss for c, u in self.pairs]

    @property
    def interval(self) -> Interval:
        return Interval.of(self.differences)


@dataclass
class Series:
    """What one norm contributes to a figure or a verdict row: the angle and ablation rows of its compared runs
    (seeds), or of one pretrained model."""
    norm: str
    angles: list[list[dict]]  # per run
    ablations: list[list[dict]]  # per run
    labels: list[str]  # per run: "seed 0", or the model


@dataclass
class Group:
    """Runs whose comparison settings are equal: they differ only in norm variant and seed."""
    settings: dict
    runs: list[Run]
    slug: str = ""  # in the names of its figures
    distinct: str = ""  # the settings that set it apart from the report's other groups
    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def model(self) -> str:
        return self.runs[0].model

    @property
    def title(self) -> str:
        return f"{self.model}" + (f" ({self.distinct})" if self.distinct else "")

    def variants(self) -> list[Variant]:
        return sorted({r.variant for r in self.runs}, key=lambda v: v.order)

    def compared(self, variant: Variant) -> list[Run]:
        return [r for r in self.runs if r.variant == variant and not r.left_out]

    def series_of(self, variant: Variant) -> Series:
        runs = self.compared(variant)
        return Series(variant.name, [r.angles for r in runs], [r.ablation for r in runs],
                      [f"seed {r.seed}" for r in runs])

    def series(self) -> list[Series]:
        return [self.series_of(v) for v in self.variants() if self.compared(v)]

    def check_and_pair(self) -> None:
        """Flag unfinished runs and replicates (left out), then pair centred and uncentred runs by seed: per bias
        setting (a 2x2 sweep gives two comparisons), else the one centred and the one uncentred norm left (the
        paper's LayerNorm and RMSNorm: the bias differs too)."""
        cells: dict[tuple[bool, bool], dict[tuple, Run]] = defaultdict(dict)  # (centred, bias) -> pairing -> run
        for run in sorted(self.runs, key=lambda r: (-(r.val_step or 0), r.name)):
            cell = cells[(run.variant.centred, run.variant.bias)]
            if run.unfinished:
                run.left_out = f"{run.unfinished}: left out"
            elif run.pairing in cell:
                run.left_out = (f"same settings, centring, bias and seed as {cell[run.pairing].name}: a replicate, "
                                "left out")
            else:
                cell[run.pairing] = run
        matched = [((True, bias), (False, bias), bias) for bias in (True, False)
                   if cells.get((True, bias)) and cells.get((False, bias))]
        left = [[c for c in cells if cells[c] and c[0] == centred and not any(c in m for m in matched)]
                for centred in (True, False)]
        if not matched and len(left[0]) == 1 and len(left[1]) == 1:
            matched.append((left[0][0], left[1][0], None))
        for centred, uncentred, bias in matched:
            common = sorted(cells[centred].keys() & cells[uncentred].keys())
            if common:
                names = ["/".join(sorted({r.variant.name for r in cells[c].values()})) for c in (centred, uncentred)]
                self.comparisons.append(
                    Comparison(bias, *names, [(cells[centred][p], cells[uncentred][p]) for p in common]))
        paired = {id(run) for c in self.comparisons for pair in c.pairs for run in pair}
        for run in [r for cell in cells.values() for r in cell.values() if id(r) not in paired]:
            run.note = "no run of the other norm with its seed: in the angle tables, not in the loss comparison"


def group_runs(runs: list[Run]) -> list[Group]:
    by_settings: dict[str, Group] = {}
    for run in runs:
        settings = comparison_settings(run.config)
        key = json.dumps(settings, sort_keys=True, default=str)
        by_settings.setdefault(key, Group(settings, [])).runs.append(run)
    groups = sorted(by_settings.values(), key=lambda g: (g.model, g.runs[0].name))
    for group in groups:
        others = [g.settings for g in groups if g is not group and g.model == group.model]  # the title names it
        differing = sorted(
            {k for o in others for k in group.settings.keys() | o.keys() if group.settings.get(k) != o.get(k)},
            key=lambda k: (k.startswith("callbacks."), k),  # callbacks last: mostly copies of other settings
        )
        shown = [f"{k}={group.settings.get(k, 'absent')}" for k in differing[:4]]
        group.distinct = ", ".join(shown) + (f" and {len(differing) - 4} more" if len(differing) > 4 else "")
        group.check_and_pair()
    for model in {g.model for g in groups}:
        same_model = [g for g in groups if g.model == model]
        for group in same_model:
            digest = hashlib.sha1(json.dumps(group.settings, sort_keys=True, default=str).encode()).hexdigest()[:8]
            group.slug = slug(model if len(same_model) == 1 else f"{model}-{digest}")
    return groups


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


@dataclass
class Pretrained:
    """A pretrained model of an angles CSV of normlab-angles (rows at step 0), with its ablation rows if given."""
    name: str
    norm: str  # "" where the CSV does not say
    csv: Path
    angles: list[dict]
    ablation: list[dict] = field(default_factory=list)

    @property
    def slug(self) -> str:
        return slug(f"pretrained-{self.name}")

    def series(self) -> list[Series]:
        return [Series(self.norm or "norm not recorded", [self.angles], [self.ablation], [self.name])]


def csv_kind(path: Path) -> str:
    header = path.open(encoding="utf-8", errors="replace").readline().strip().split(",")
    if "mean_deg" in header:
        return "angles"
    if "delta" in header and "site" in header:
        return "ablation"
    raise AnalysisError(f"{path} is neither an angles CSV (normlab-angles) nor an ablation CSV (normlab-ablate): "
                        "give the CSVs those commands write")


def load_pretrained(paths: list[Path]) -> list[Pretrained]:
    """The models of the angles CSVs in `paths`, one per (run, norm) of their identity columns (normlab-angles
    names a Hugging Face model's run after its directory, its model after its type; the file's name where the CSV
    has neither); the rows of ablation CSVs join the model their `run` (or `model`) names."""
    models: dict[tuple, Pretrained] = {}
    ablations: list[dict] = []
    for path in paths:
        if not path.is_file():
            raise AnalysisError(f"{path} does not exist: give the CSV files of normlab-angles or normlab-ablate")
        if csv_kind(path) == "ablation":
            ablations += read_ablation(path)
            continue
        for row in read_angles(path, f"regenerate it with normlab-angles model_path=<the model> out={path}"):
            name, norm = row.get("run") or row.get("model") or path.stem, row.get("norm") or ""
            models.setdefault((name, norm), Pretrained(name, norm, path, [])).angles.append(row)
    for model in models.values():
        model.ablation = [r for r in ablations if model.name in (r.get("run"), r.get("model"))]
    return sorted(models.values(), key=lambda m: m.name)


# -- angle profiles: per norm site, averaged over seeds


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

    @property
    def null_sd(self) -> float:
        return self.random_sd if self.random_sd is not None else self.iid_sd

    @property
    def deviation(self) -> float:
        """(mean - 90) in null standard deviations of a mean angle."""
        return (self.mean - 90) / self.null_sd if self.null_sd > 0 else math.inf


def mean_or_none(values: list) -> float | None:
    return None if any(v is None for v in values) else statistics.fmean(values)


def profile(tables: list[list[dict]], io: str, reference: str, step: int | None = None) -> dict[tuple, Point]:
    """Per norm site (input or output), the runs' angle to `reference` over all positions at `step` (default:
    each run's last measured step), averaged over the runs that measured it."""
    by_site: dict[tuple, list[dict]] = defaultdict(list)
    for rows in tables:
        at = last_step(rows) if step is None else step
        for row in rows:
            if (row["step"] == at and row["position"] == "all" and row["reference"] == reference
                    and row["site"].endswith(f".{io}")):
                by_site[site_key(row)].append(row)
    points = {}
    for key, rows in by_site.items():
        means = [r["mean_deg"] for r in rows]
        points[key] = Point(
            steps={r["step"] for r in rows},
            mean=statistics.fmean(means),
            seed_sd=statistics.stdev(means) if len(means) > 1 else None,
            token_sd=statistics.fmean(r["std_deg"] for r in rows),
            share=statistics.fmean(r["mean_cos2"] for r in rows),
            d=rows[0]["d"],
            random_mean=mean_or_none([r.get("null_random_mean_deg") for r in rows]),
            random_sd=mean_or_none([r.get("null_random_std_deg") for r in rows]),
            single_sd=statistics.fmean(r["null_std_deg"] for r in rows),
            iid_sd=statistics.fmean(r["null_std_deg"] / math.sqrt(r["count"]) for r in rows),
        )
    return dict(sorted(points.items(), key=lambda item: site_sort(item[0])))


# -- figures: PDF and PNG, shared axes, one tick per norm site


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


def plot_angles_by_layer(title: str, series: list[Series], out: Path, name: str) -> str | None:
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


def runs_text(count: int) -> str:
    return f"{count} run{'s' * (count != 1)}"


def step_text(profiles) -> str:
    steps = sorted({s for p in profiles for point in p.values() for s in point.steps})
    return ", ".join(f"{s:,}" for s in steps)


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


def last_rows(rows: list[dict]) -> list[dict]:
    at = last_step(rows)
    return [r for r in rows if r.get("step") == at]


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


# -- tables


def parameter_count(config: dict, cache: dict) -> int:
    key = json.dumps([config["model"], config["norm"]], sort_keys=True, default=str)
    if key not in cache:
        import torch

        from normlab.training.pipeline import build_model

        with torch.device("meta"):
            cache[key] = build_model(OmegaConf.create(config)).num_params()
    return cache[key]


def runs_table(group: Group, parameters: dict) -> str:
    lines = ["| run | norm | seed | parameters | step | final val loss | tokens/s (median) | status |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for run in sorted(group.runs, key=lambda r: (r.variant.order, r.seed, r.name)):
        rates = [v for _, v in run.metrics.get("train/tokens_per_sec", [])[1:]]  # the first includes warm-up
        step = f"{run.val_step or 0:,}" + (f" of {run.max_steps:,}" if run.max_steps else "")
        status = f"**{run.left_out}**" if run.left_out else "compared" + (f"; {run.note}" if run.note else "")
        lines.append(f"| {run.name} | {run.variant.name} | {run.seed} | {parameter_count(run.config, parameters):,} "
                     f"| {step} | {run.final_val_loss:.4f} | {statistics.median(rates) if rates else math.nan:,.0f} "
                     f"| {status} |")
    return "\n".join(lines) + "\n"


def comparison_table(group: Group) -> str:
    if not group.comparisons:
        return "No pair to compare: the group needs a centred and an uncentred finished run of one seed.\n"
    lines = ["| comparison | pairs (seeds) | difference per seed | mean | sd | 95% CI (t) | excludes 0 |",
             "|---|---|---|---:|---:|---|---|"]
    for c in group.comparisons:
        i = c.interval
        seeds = ", ".join(str(centred.seed) for centred, _ in c.pairs)
        per_seed = ", ".join(f"{d:+.4f}" for d in c.differences)
        ci = "no interval: one pair" if i.low is None else f"[{i.low:+.4f}, {i.high:+.4f}]"
        sd = "—" if i.sd is None else f"{i.sd:.4f}"
        excludes = "—" if i.excludes_zero is None else "**yes**" if i.excludes_zero else "no"
        lines.append(f"| {c.label} | {i.n} ({seeds}) | {per_seed} | {i.mean:+.4f} | {sd} | {ci} | {excludes} |")
    return "\n".join(lines) + "\n"


def evaluation_values(run: Run) -> dict[tuple[str, str], tuple[int, float]]:
    """(task, metric) -> (step, value) of a run's normlab-eval rows, at the newest step evaluated."""
    values = {}
    for row in sorted(run.evaluation, key=lambda r: r["step"]):
        if row["value"] is not None:
            values[(row["task"], row["metric"])] = (row["step"], row["value"])
    return values


def evaluation_table(group: Group) -> str:
    """Per comparison, task and metric of normlab-eval: uncentred minus centred, paired by seed, with its t
    interval."""
    lines = ["| comparison | task | metric | pairs (seeds) | steps | difference per seed | mean | 95% CI (t) | "
             "excludes 0 |", "|---|---|---|---|---|---|---:|---|---|"]
    for c in group.comparisons:
        pairs = [(centred, evaluation_values(centred), evaluation_values(uncentred)) for centred, uncentred in c.pairs]
        for task, metric in sorted({k for _, cv, uv in pairs for k in cv.keys() & uv.keys()}):
            found = [(run.seed, cv[(task, metric)], uv[(task, metric)]) for run, cv, uv in pairs
                     if (task, metric) in cv and (task, metric) in uv]
            differences = [u[1] - v[1] for _, v, u in found]
            i = Interval.of(differences)
            ci = "no interval: one pair" if i.low is None else f"[{i.low:+.4f}, {i.high:+.4f}]"
            excludes = "—" if i.excludes_zero is None else "**yes**" if i.excludes_zero else "no"
            steps = ", ".join(sorted({f"{v[0]:,}/{u[0]:,}" for _, v, u in found}))
            lines.append(f"| {c.label} | {task} | {metric} | {i.n} ({', '.join(str(s) for s, _, _ in found)}) | "
                         f"{steps} | {', '.join(f'{d:+.4f}' for d in differences)} | {i.mean:+.4f} | {ci} | "
                         f"{excludes} |")
    if len(lines) == 2:
        return ""
    return "\n".join(lines) + "\n\nSteps: the centred/uncentred run's checkpoint (its newest in eval/results.csv).\n"


def layer_table(series: list[Series]) -> str:
    """Per norm input: each norm's angle to 1 (mean over seeds ± their sd), its deviation in null sds and the
    share of the squared norm along 1."""
    profiles = [(s, profile(s.angles, "input", "uniform")) for s in series]
    profiles = [(s, p) for s, p in profiles if p]
    if not profiles:
        return ""
    keys = sorted({k for _, p in profiles for k in p}, key=site_sort)
    header = ["norm input"]
    for s, p in profiles:
        header += [f"{s.norm}: angle to 1 (step {step_text([p])}, {runs_text(len(s.angles))})",
                   "(angle − 90) / null sd", "share along 1"]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for key in keys:
        cells = [site_tick(key)]
        for _, p in profiles:
            point = p.get(key)
            if point is None:
                cells += ["—"] * 3
                continue
            spread = f" ± {point.seed_sd:.2f}" if point.seed_sd is not None else ""
            marker = "" if point.random_sd is not None else "‡"
            cells += [f"{point.mean:.2f}{spread}", f"{point.deviation:+.1f}{marker}", f"{point.share:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    d = profiles[0][1][keys[0]].d if keys[0] in profiles[0][1] else None
    null = f" (null for a random direction: 1/d = {1 / d:.4f})" if d else ""
    return "\n".join(lines) + f"\n\nShare along 1: the mean cos² of the angle{null}.\n"


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


def group_section(group: Group, parameters: dict) -> str:
    text = [f"## {group.title}\n"]
    if group.model in DEMO_MODELS:
        text.append(f"*{DEMO_NOTE}.*\n")
    text += ["### Runs\n", runs_table(group, parameters), "### Final validation loss, paired by seed\n",
             comparison_table(group)]
    if table := evaluation_table(group):
        text += ["### Evaluation (normlab-eval), uncentred − centred, paired by seed\n", table]
    if table := layer_table(group.series()):
        text += ["### Angle to 1 at the norm inputs, per layer (mean over seeds ± their sd)\n", table]
    return "\n".join(text)


def pretrained_section(model: Pretrained) -> str:
    return "\n".join([f"## {model.name} (pretrained, {model.norm or 'norm not recorded'}; {model.csv})\n",
                      layer_table(model.series())])


def images(figures: list[str]) -> str:
    return "".join(f"\n![{f}]({f})\n" for f in figures) + "\n"


# -- the report


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


def report(paths: list[Path], out: Path, csvs: list[Path] = ()) -> None:
    for path in paths:
        if not path.exists():
            raise AnalysisError(f"{path} does not exist: give run directories, or directories holding runs")
    # new, empty, or an earlier report holding only what it wrote (its marker), which it replaces: outputs.py
    outputs.check_folder(out, COMMAND, owned_in_run=("report",))
    runs, replaced = find_runs(paths)
    pretrained = load_pretrained(list(csvs))
    if not runs and not pretrained:
        raise AnalysisError(f"no run (metrics.csv + config.yaml) under {', '.join(map(str, paths))}")
    groups = group_runs(runs)
    verdict = "\n".join([VERDICT_HEADER, *[r for g in groups for r in verdict_rows(g)],
                         *[pretrained_row(m) for m in pretrained]]) + "\n"
    head = f"# normlab report\n\n## Verdict\n\n{verdict}\n{footnotes(groups, pretrained)}{HOW_TO_READ}\n"
    if replaced:
        head += "Skipped (runs moved aside by restart=true): " + ", ".join(f"`{p}`" for p in replaced) + "\n\n"
    parameters: dict = {}
    sections = [group_section(g, parameters) for g in groups] + [pretrained_section(m) for m in pretrained]
    # the tables are ready: a failure before this point writes nothing, one after it leaves the old report whole
    with outputs.staged_folder(out, COMMAND) as staging, plt.rc_context(STYLE):
        figures = [draw_group(g, staging) for g in groups] + [draw_pretrained(m, staging) for m in pretrained]
        (staging / "summary.md").write_text(head + "".join(t + images(f) for t, f in zip(sections, figures)))
    count = sum(len(f) for f in figures)
    print(verdict + f"\nwrote summary.md and {count} figures (PDF and PNG, {DPI} dpi) to {out}")


def as_paths(value) -> list[Path]:
    values = value if OmegaConf.is_list(value) or isinstance(value, list) else [value]
    return [Path(str(p)) for p in values if p is not None and str(p).strip()]


def main(cfg: DictConfig) -> None:
    """normlab-report (conf/report.yaml, normlab.cli.report): the report of `runs` (run directories, folders of runs,
    angles CSVs) and `csvs` (angles and ablation CSVs of pretrained models) into `out`."""
    given = as_paths(None if OmegaConf.is_missing(cfg, "runs") else cfg.runs) + as_paths(cfg.get("csvs") or [])
    if not given:
        raise AnalysisError("no runs given: runs=DIR or runs=[DIR,...] (run directories, or directories holding runs), "
                            "or csvs=[FILE.csv,...] (angles CSVs of pretrained models)")
    csvs = [p for p in given if p.suffix == ".csv"]
    paths = [p for p in given if p.suffix != ".csv"]
    report(paths, Path(str(cfg.out)) if cfg.out else (paths[0] if paths else csvs[0].parent) / "report", csvs)
