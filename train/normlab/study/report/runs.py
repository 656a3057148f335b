"""Reading what the report compares: run directories (config.yaml, metrics.csv, and the angles.csv, ablation.csv and
eval/results.csv beside them) into Runs, with each run's norm (its identity, and what its class says it is), the step
of its checkpoints (whether it finished) and its values that are not finite numbers left out (`screened`, one warning
per file); `.replaced-*` folders are skipped, and folders without training metrics (normlab-convert's) found to be
listed (`untrained_runs`)."""

import functools
import json
import math
import os
import shlex
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from normlab.common.moved import current_config
from normlab.probe.table import AnalysisError, DamagedTable, read_rows
from normlab.training.rundir.files import warn
from normlab.training.rundir.tables import step_ranges

if TYPE_CHECKING:
    from normlab.model.norms import Traits


# The arms of a branch group (docs/branch.md) beside the norms as they train from step K
CONTROL = "zero-mean writers"  # branch.zero_mean_writers: the LayerNorm function in an RMSNorm model
CONTINUING = "source, continuing"  # the source run, continuing past K with its own optimizer state


@dataclass(frozen=True)
class Arm:
    """A norm as the report compares it: its identity, the norm's name and its layer's settings (norm.name and
    norm.layer: runs of one group are compared, and replicates found, by it); what its class says it is (traits);
    and the colour and marker its config gives its figures (norm.style, where it has one)."""
    name: str
    layer: str  # norm.layer, as JSON with sorted keys
    traits: "Traits" = field(compare=False)
    style: dict | None = field(default=None, compare=False, hash=False)
    sites: str = "{}"  # norm.sites less what equals norm.layer's, as JSON: {"mlp": {"alpha_init": 0.05}}
    variant: str = ""  # of a branch group: CONTROL, or CONTINUING (its source); "" for the norm as it trains

    @property
    def settings(self) -> dict:
        """norm.layer's settings, then those of a site kind where they differ (`mlp.alpha_init`)."""
        per_site = {f"{kind}.{k}": v for kind, settings in json.loads(self.sites).items() for k, v in settings.items()}
        return json.loads(self.layer) | per_site

    @property
    def order(self) -> tuple:  # the 2x2: layernorm, rmsnorm_bias, layernorm_nobias, rmsnorm; then the others (dyt)
        t = self.traits
        return (not t.centring_pair, not t.normalizes, not t.bias, not t.centres, self.name, self.layer,
                self.variant != CONTINUING, self.variant)


@functools.cache
def layer_traits(layer: str) -> "Traits":
    """What the norm class of `layer` (norm.layer, as JSON) says it is: the class imported and checked as every
    command checks a norm (model.norms.contract_violation, at width 8), a layer of it asked with model.norms.traits
    (the class answers, whatever keys an older config.yaml holds beside it)."""
    from normlab.model.norms import contract_violation, norm_class, source_of, traits

    settings = json.loads(layer)
    target = str(settings.get("_target_"))
    try:
        cls = norm_class(target)
    except ValueError as e:
        raise AnalysisError(f"its norm class {target} cannot be imported: {e}") from None
    arguments = {k: v for k, v in settings.items() if not k.startswith("_")}
    if problem := contract_violation(cls, {"norm.layer": arguments}, 8):
        raise AnalysisError(f"its norm {target} ({source_of(cls)}): {problem}")
    return traits(cls(8, **arguments))


def arm_of(config: dict, path: Path, role: str = "") -> Arm:
    """The norm of a run's config (`path`, its config.yaml); `role`: CONTINUING for a branch's source."""
    norm = config["norm"]
    settings = norm.get("layer") or {}
    layer = json.dumps(settings, sort_keys=True, default=str)
    try:
        traits = layer_traits(layer)
    except AnalysisError as e:
        raise AnalysisError(f"{path}: {e}") from None
    sites = {kind: differing for kind, given in (norm.get("sites") or {}).items()
             if (differing := {k: v for k, v in given.items() if settings.get(k) != v})}
    variant = role or (CONTROL if (config.get("branch") or {}).get("zero_mean_writers") else "")
    return Arm(str(norm["name"]), layer, traits, norm.get("style") or None, json.dumps(sites, sort_keys=True), variant)


INT_COLUMNS = {"step", "layer", "count", "d", "seed", "windows", "tokens", "null_directions", "resampling_units"}
FLOAT_COLUMNS = {"mean_deg", "std_deg", "min_deg", "max_deg", "mean_norm", "mean_cos2", "null_mean_deg", "null_std_deg",
                 "sem_deg", "null_percentile", "null_random_mean_deg", "null_random_std_deg", "loss", "ablated_loss",
                 "delta", "ci_low", "ci_high", "share_along_1", "value", "stderr"}
LIST_COLUMNS = {"null_random_means_deg", "null_random_cos2"}  # floats separated by spaces
ANGLE_COLUMNS = ("step", "layer", "site", "reference", "position", "count", "mean_deg", "std_deg", "mean_cos2",
                 "null_std_deg", "d")  # what the report needs of an angles CSV; any other column is optional
ABLATION_COLUMNS = ("site", "delta")
ALONG_1 = "1"  # an ablation row's direction: along 1, or "random k" (the null)
EVAL_COLUMNS = ("step", "task", "metric", "value")


def table_value(column: str, value: str) -> int | float | list[float] | str | None:
    """A value of an angles or ablation CSV, read by its column's name: numbers where the report computes with
    them (empty: None), a list of them for null_random_means_deg, any other column as its text."""
    if column in INT_COLUMNS:
        number = float(value) if value else None
        return int(number) if number is not None and math.isfinite(number) else number  # nan, inf: screened out
    if column in FLOAT_COLUMNS:
        return float(value) if value else None
    if column in LIST_COLUMNS:
        return [float(v) for v in value.split()] or None
    return value


# the columns without which a row says nothing: a row whose value there is missing or not finite is left out whole
NEEDED = {"angles": ANGLE_COLUMNS[:2] + ("count", "mean_deg", "std_deg", "mean_cos2", "null_std_deg", "d"),
          "ablation": ("step", "delta"), "evaluation": ("step", "value"), "metrics": ()}


def not_finite(value) -> bool:
    if isinstance(value, list):
        return any(not_finite(v) for v in value)
    return isinstance(value, float) and not math.isfinite(value)


def screened(path: Path, rows: list[dict], kind: str) -> tuple[list[dict], dict[str, list[int]]]:
    """The rows of a table that the report reads, less their values that are not finite numbers (nan, inf): a row
    is left out where that value, or a missing one, is in a NEEDED column, else just the value (None: not there).
    One warning line names the file, each column and its steps (or lines); returned too: column -> steps."""
    needed, kept, found = NEEDED[kind], [], defaultdict(list)
    for line, row in enumerate(rows, start=2):
        bad = [c for c, v in row.items() if not_finite(v) or (c in needed and v is None)]
        dropped = [c for c in bad if c in needed]  # the row is left out: these say why
        for column in dropped or bad:
            found[column].append(row["step"] if isinstance(row.get("step"), int) else -line)  # no step: its line
            row[column] = None
        if not dropped:
            kept.append(row)
    if found:
        warn(f"{path}: left out of the report, as not finite or missing: "
             + "; ".join(f"{column} at {where(places)}" + (" (those rows)" if column in needed else "")
                         for column, places in found.items()))
    return kept, {column: [s for s in places if s >= 0] for column, places in found.items()}


def where(places: list[int]) -> str:
    """'steps 0, 6 (3 rows)' for steps [0, 6, 6], 'line 7' for -7 (a row without a step)."""
    steps, lines = sorted({s for s in places if s >= 0}), sorted(-s for s in places if s < 0)
    parts = [f"step{'s' * (len(steps) > 1)} {step_ranges(steps)}"] if steps else []
    parts += [f"line{'s' * (len(lines) > 1)} {', '.join(map(str, lines))}"] if lines else []
    rows = f" ({len(places)} rows)" if len(places) > len(steps) + len(lines) else ""
    return " and ".join(parts) + rows


def metric_value(column: str, value: str) -> int | float | None:
    """A value of metrics.csv: the step, or a metric (None where the row does not log it)."""
    return int(value) if column == "step" else float(value) if value else None


RUN_CONFIG_KEYS = ("model.name", "norm.name", "seed")  # what the report needs of a run's config.yaml
# A run learned more than token frequencies if its final loss is this far below their cross-entropy (nats/token): a
# language model's first gain beyond unigram statistics is several tenths (bigrams), 0.1 leaves rounding far behind
LEARNED_MARGIN = 0.1
# A run did more than a table of which token follows which if its final loss is this far below that table's
# cross-entropy (data/bigram.py): the table's own estimate moves by a few hundredths with the text it is fit on
BIGRAM_MARGIN = 0.05


def read_config(path: Path) -> dict:
    """A run's config.yaml, its classes named by their place now (a run written before normlab had subpackages
    names them by the old one, and must group with runs written since)."""
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
    return current_config(OmegaConf.to_container(config))


def read_angles(path: Path, remedy: str) -> list[dict]:
    try:
        return screened(path, read_rows(path, table_value, ANGLE_COLUMNS), "angles")[0]
    except DamagedTable as e:
        raise AnalysisError(f"{e}: {remedy}") from None


def read_evaluation(path: Path) -> list[dict]:
    try:
        return screened(path, read_rows(path, table_value, EVAL_COLUMNS), "evaluation")[0]
    except DamagedTable as e:
        raise AnalysisError(f"{e}: move it aside and evaluate the run again with normlab-eval") from None


def read_ablation(path: Path) -> list[dict]:
    try:
        return screened(path, read_rows(path, table_value, ABLATION_COLUMNS), "ablation")[0]
    except DamagedTable as e:
        raise AnalysisError(f"{e}: write it again with normlab-ablate") from None


def along_1(rows: list[dict]) -> list[dict]:
    """The ablation's own rows (direction 1, or a CSV written before normlab-ablate had a null)."""
    return [r for r in rows if (r.get("direction") or ALONG_1) == ALONG_1]


def null_rows(rows: list[dict]) -> list[dict]:
    """The null's rows: the same ablation at every norm at once along a random direction in place of 1."""
    return [r for r in rows if (r.get("direction") or ALONG_1) != ALONG_1]


def saved_step(run_dir: Path) -> int | None:
    """The highest step the run's checkpoints hold, as their digest files record it (checkpoints.py; not
    verified: the training run that resumes from them does that); None where it has none."""
    from normlab.training.rundir.checkpoints import recorded_step  # here: it imports torch

    steps = [recorded_step(p) for p in (run_dir / "checkpoints").glob("*.ckpt") if not p.name.startswith("nonfinite")]
    return max(steps) if steps and max(steps) >= 0 else None


def repair_command(run_dir: Path) -> str:
    """The normlab-train command that trained the run (its overrides.yaml), aimed at the directory the run is in now:
    run again, it repairs metrics.csv and angles.csv."""
    try:
        overrides = [str(o) for o in OmegaConf.load(run_dir / "overrides.yaml")]
    except Exception:  # noqa: BLE001 (yaml's and OmegaConf's errors alike: none, or damaged)
        return f"normlab-train <the overrides that trained it> run_dir={run_dir.absolute()}"
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in ("run_dir", "restart")]
    return shlex.join(["normlab-train", *kept, f"run_dir={run_dir.absolute()}"])


@dataclass(frozen=True)
class Run:
    """A run directory as read (load_run): its config and tables, once; the report's screening and notes are copies
    (dataclasses.replace), never changes of it."""
    dir: Path
    name: str  # the run directory, relative to the folder the report's runs share
    config: dict
    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    angles: list[dict] = field(default_factory=list)
    ablation: list[dict] = field(default_factory=list)  # along 1, and the null's rows along random directions
    evaluation: list[dict] = field(default_factory=list)  # eval/results.csv of normlab-eval
    left_out: str = ""  # why the run is not compared ("": it is)
    note: str = ""  # what else the runs table says of it
    saved_step: int | None = None  # the highest step of its checkpoints (None: none, e.g. a copy of its tables)
    nonfinite: dict[str, list[int]] = field(default_factory=dict)  # metrics.csv: column -> steps not finite
    unigram_loss: float | None = None  # its data's held-out unigram cross-entropy (data/unigram.py): the learning check
    bigram_loss: float | None = None  # and its count bigram model's (data/bigram.py): the bar beyond a lookup table
    role: str = ""  # CONTINUING: a branch's source, read into the branch's group (with_sources)

    @property
    def model(self) -> str:
        return str(self.config["model"]["name"])

    @functools.cached_property
    def norm(self) -> Arm:
        return arm_of(self.config, self.dir / "config.yaml", self.role)

    @property
    def seed(self) -> int:
        return self.config["seed"]

    @property
    def branch_source(self) -> Path | None:
        """The run a branch started from (branch.source), None for a run that is no branch."""
        source = (self.config.get("branch") or {}).get("source")
        return Path(str(source)) if source else None

    @property
    def pairing(self) -> tuple:
        """Runs of one group with equal pairing start from the same weights and see the same batches: the seeds,
        and for a branch the run it started from (for its source continuing: itself)."""
        seeds = self.seed, (self.config.get("data") or {}).get("seed", self.seed)
        source = self.dir if self.role == CONTINUING else self.branch_source
        return seeds + ((str(source.resolve()),) if source else ())

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
    def final_validations(self) -> list[tuple[int, float]]:
        """(step, loss) of the validations its final loss averages: the last `analysis.final_validations` of its
        config (declared with the run; 1 for a run trained before normlab had it)."""
        count = ((self.config.get("analysis") or {}).get("final_validations") or 1)
        return [(step + 1, loss) for step, loss in self.metrics.get("val/loss", [])[-count:]]

    @property
    def final_val_loss(self) -> float:
        """The mean of its final validations' losses (nan: none)."""
        found = self.final_validations
        return math.fsum(loss for _, loss in found) / len(found) if found else math.nan

    @property
    def learned(self) -> bool | None:
        """Whether its final loss lies clearly (LEARNED_MARGIN) below the unigram cross-entropy of its data; None
        where either is unknown."""
        if self.unigram_loss is None or not math.isfinite(self.final_val_loss):
            return None
        return self.final_val_loss < self.unigram_loss - LEARNED_MARGIN

    @property
    def beyond_bigrams(self) -> bool | None:
        """Whether its final loss lies clearly (BIGRAM_MARGIN) below the held-out cross-entropy of a count bigram
        model of its data; None where either is unknown."""
        if self.bigram_loss is None or not math.isfinite(self.final_val_loss):
            return None
        return self.final_val_loss < self.bigram_loss - BIGRAM_MARGIN

    @property
    def diverged(self) -> bool:
        """Whether its last validation loss in metrics.csv is not finite (the earlier finite ones are no final loss)."""
        bad = self.nonfinite.get("val/loss")
        return bool(bad) and max(bad) + 1 > (self.val_step or 0)

    @property
    def incomplete(self) -> str:
        """Why the run's final validation loss cannot be compared ('' when it can): the run is unfinished (by the
        steps of its checkpoints, or where it has none by its last validation row), or that loss is not finite, or
        metrics.csv lacks it (a finished run: rerunning its command validates its final checkpoint again)."""
        final, validated = self.max_steps, self.val_step
        if final is not None and self.saved_step is not None and self.saved_step < final:
            return f"unfinished: step {self.saved_step:,} of {final:,}"
        if self.diverged:
            return f"final val loss (after step {max(self.nonfinite['val/loss']) + 1:,}) not finite in metrics.csv"
        if final is None or self.saved_step is None:
            if validated is None:
                return "unfinished: no validation yet"
            return f"unfinished: step {validated:,} of {final:,}" if final is not None and validated < final else ""
        if validated != final:
            return (f"metrics.csv has no validation of its final step {final:,}, which its checkpoint holds: "
                    f"`{repair_command(self.dir)}` puts it back")
        return ""


@functools.cache
def unigram_loss(data_dir: str) -> float | None:
    from normlab.data.unigram import held_out_loss  # here: it imports numpy

    return held_out_loss(Path(data_dir))


@functools.cache
def bigram_loss(data_dir: str) -> float | None:
    from normlab.data.bigram import held_out_loss  # here: it imports numpy

    return held_out_loss(Path(data_dir))


def load_run(run_dir: Path, name: str, role: str = "") -> Run:
    config = read_config(run_dir / "config.yaml")
    data_dir = str((config.get("data") or {}).get("dir") or "")
    try:
        rows, nonfinite = screened(run_dir / "metrics.csv", read_rows(run_dir / "metrics.csv", metric_value), "metrics")
    except DamagedTable as e:
        raise AnalysisError(f"{e}: rerun the same normlab-train command, which repairs it: "
                            f"{repair_command(run_dir)}") from None
    metrics: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "epoch") and value is not None:
                metrics.setdefault(key, []).append((row["step"], value))
    for values in metrics.values():
        values.sort(key=lambda item: item[0])
    angles = read_angles(
        run_dir / "angles.csv",
        f"rerun the same normlab-train command, which repairs it, or regenerate it with normlab-angles "
        f"model_path={run_dir} out={run_dir / 'angles.csv'}",
    ) if (run_dir / "angles.csv").is_file() else []
    ablation = read_ablation(run_dir / "ablation.csv") if (run_dir / "ablation.csv").is_file() else []
    evaluation = (read_evaluation(run_dir / "eval" / "results.csv") if (run_dir / "eval" / "results.csv").is_file()
                  else [])
    return Run(run_dir, name, config, metrics, angles, ablation, evaluation, saved_step=saved_step(run_dir),
               nonfinite=nonfinite, unigram_loss=unigram_loss(data_dir) if data_dir else None,
               bigram_loss=bigram_loss(data_dir) if data_dir else None, role=role)


def files_named(root: Path, name: str) -> list[Path]:
    """The files called `name` at or under `root`, through symbolic links to folders (a folder of links to chosen
    runs is a way to work), each folder visited once (a link that loops back is not followed again)."""
    found, visited = [], set()
    for folder, subfolders, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in visited:
            subfolders[:] = []
            continue
        visited.add(real)
        subfolders.sort()
        if name in files:
            found.append(Path(folder) / name)
    return found


def find_runs(paths: list[Path]) -> tuple[list[Run], list[Path]]:
    """The runs (metrics.csv + config.yaml) at or under `paths` (symbolic links followed), and the `.replaced-*`
    folders skipped there."""
    dirs, replaced = set(), set()
    for root in paths:
        for metrics in files_named(root, "metrics.csv"):
            parts = metrics.parent.relative_to(root).parts
            aside = [i for i, part in enumerate(parts) if ".replaced-" in part]
            if aside:
                replaced.add(root.joinpath(*parts[: aside[0] + 1]))
            elif (metrics.parent / "config.yaml").is_file():
                dirs.add(metrics.parent)
    dirs = sorted({d.resolve(): d for d in sorted(dirs, reverse=True)}.values())  # a run reached twice: once
    common = Path(os.path.commonpath([d.resolve() for d in dirs])) if len(dirs) > 1 else None
    runs = [load_run(d, str(d.resolve().relative_to(common)) if common else d.resolve().name) for d in dirs]
    return runs, sorted(replaced)


def with_sources(branches: list[Run]) -> list[Run]:
    """The branches, and the source of each as a run of its own (role CONTINUING), read anew for their group: the
    source continuing past K with its own optimizer state, against which the branch of its own norm measures what the
    restart costs. A branch whose source is not there (moved, or on another machine) comes back noted."""
    found: dict[str, Run] = {}
    noted = []
    for run in branches:
        source = run.branch_source
        key = str(source.resolve()) if source is not None else None
        if key and key not in found and (source / "metrics.csv").is_file() and (source / "config.yaml").is_file():
            found[key] = load_run(source, f"{source.name} (source)", CONTINUING)
        if key and key not in found:
            where = "" if source.is_absolute() else f" at {source.resolve()}"
            run = replace(run, note=f"its source {source} is not there (no metrics.csv{where}): not compared with its "
                                    "source continuing")
        noted.append(run)
    return noted + list(found.values())


def untrained_runs(paths: list[Path]) -> list[tuple[Path, str]]:
    """The run directories at or under `paths` with a config.yaml and a checkpoint but no metrics.csv, which have no
    training metrics to compare (a model of normlab-convert; a run that lost its metrics.csv, or logged nothing), each
    with what it is; none in `.replaced-*` folders."""
    found = []
    for root in paths:
        for config in sorted(files_named(root, "config.yaml")):
            run = config.parent
            if (".replaced-" in str(run.relative_to(root)) or (run / "metrics.csv").exists()
                    or not any((run / "checkpoints").glob("*.ckpt"))):
                continue
            try:
                source = OmegaConf.select(OmegaConf.load(config), "converted_from.path")
            except Exception:  # noqa: BLE001 (yaml's and OmegaConf's errors alike: not a config this could read)
                source = None
            found.append((run, f"converted by normlab-convert from `{source}`" if source else
                          "a run without metrics.csv (lost, or nothing logged yet)"))
    return found
