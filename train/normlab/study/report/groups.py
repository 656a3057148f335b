"""Groups, pairs and the paired comparison: runs grouped by their comparison settings (everything but the norm
variant, the seed and what only names, places, logs or speeds up a run), centred and uncentred runs of a group paired
by seed, a layer that does not normalize (DyT) paired with LayerNorm by seed, and the series of angle and ablation
rows each norm contributes to the tables and figures."""

import hashlib
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field

from normlab.common.paths import identifies_the_run
from normlab.probe.figure import AngleSeries
from normlab.probe.profiles import last_step
from normlab.study.report.intervals import Interval
from normlab.study.report.runs import Run, Variant
from normlab.training.run_config import flat

VARIANT_KEYS = ("name", "centred", "bias", "normalizes", "_target_")  # below norm: what tells the variants apart
LAYER_SETTINGS = "norm.layer."  # the layer's own: eps for a norm, alpha_init for DyT
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
    """Uncentred minus centred final validation loss, paired by seed: RMS − LN for one bias setting (the centring's
    effect), or, `pointwise`, a layer that does not normalize (DyT) − LayerNorm: everything the norm does."""
    bias: bool | None  # None: the two norms differ in the bias too
    centred: str  # the norm names
    uncentred: str
    pairs: list[tuple[Run, Run]]  # (centred, uncentred)
    pointwise: bool = False

    @property
    def label(self) -> str:
        if self.pointwise:
            bias = "; the bias differs too" if self.bias is None else "" if self.bias else ", both without bias"
            return f"{self.uncentred} − {self.centred} (no norm: tanh in place of LayerNorm{bias})"
        bias = "the bias differs too" if self.bias is None else "with bias" if self.bias else "without bias"
        return f"{self.uncentred} − {self.centred} ({bias})"

    @property
    def differences(self) -> list[float]:
        return [u.final_val_loss - c.final_val_loss for c, u in self.pairs]

    @property
    def interval(self) -> Interval:
        return Interval.of(self.differences)


@dataclass
class Series(AngleSeries):
    """What one norm contributes to a figure or a verdict row: the angle and ablation rows of its compared runs
    (seeds), or of one pretrained model."""
    ablations: list[list[dict]]  # per run
    labels: list[str]  # per run: "seed 0", or the model
    normalizes: bool = True  # False: DyT, whose ablation centres the input of its tanh


def last_rows(rows: list[dict]) -> list[dict]:
    """The rows of a table at its newest step."""
    at = last_step(rows)
    return [r for r in rows if r.get("step") == at]


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
                      [f"seed {r.seed}" for r in runs], variant.normalizes)

    def series(self) -> list[Series]:
        return [self.series_of(v) for v in self.variants() if self.compared(v)]

    def check_and_pair(self) -> None:
        """Flag runs without a final loss to compare (Run.incomplete: unfinished, ...) and replicates (left out),
        then pair centred and uncentred runs by seed: per bias setting (a 2x2 sweep gives two comparisons), else the
        one centred and the one uncentred norm left (the paper's LayerNorm and RMSNorm: the bias differs too). A layer
        that does not normalize (DyT) stays out of those cells: it is paired with the centred norm of its bias setting,
        else the one with a bias."""
        cells: dict[tuple[bool, bool], dict[tuple, Run]] = defaultdict(dict)  # (centred, bias) -> pairing -> run
        pointwise: dict[Variant, dict[tuple, Run]] = defaultdict(dict)  # the layers that do not normalize
        for run in sorted(self.runs, key=lambda r: (-(r.val_step or 0), r.name)):
            variant = run.variant
            cell = cells[(variant.centred, variant.bias)] if variant.normalizes else pointwise[variant]
            if run.incomplete:
                run.left_out = f"{run.incomplete}: left out"
            elif run.pairing in cell:
                same = "centring, bias" if variant.normalizes else "layer"
                run.left_out = f"same settings, {same} and seed as {cell[run.pairing].name}: a replicate, left out"
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
                names = [cell_names(cells[c]) for c in (centred, uncentred)]
                self.comparisons.append(
                    Comparison(bias, *names, [(cells[centred][p], cells[uncentred][p]) for p in common]))
        for variant, runs in sorted(pointwise.items(), key=lambda item: item[0].order):
            shared = [key for key in ((True, variant.bias), (True, True)) if cells.get(key, {}).keys() & runs.keys()]
            if shared:
                reference = cells[shared[0]]
                pairs = [(reference[p], runs[p]) for p in sorted(reference.keys() & runs.keys())]
                bias = variant.bias if shared[0][1] == variant.bias else None
                self.comparisons.append(Comparison(bias, cell_names(reference), variant.name, pairs, pointwise=True))
        paired = {id(run) for c in self.comparisons for pair in c.pairs for run in pair}
        for run in [r for cell in cells.values() for r in cell.values() if id(r) not in paired]:
            run.note = "no run of the other norm with its seed: in the angle tables, not in the loss comparison"
        for run in [r for cell in pointwise.values() for r in cell.values() if id(r) not in paired]:
            run.note = "no LayerNorm run with its seed: in the angle tables, not in the loss comparison"


def cell_names(cell: dict[tuple, Run]) -> str:
    return "/".join(sorted({r.variant.name for r in cell.values()}))


def join_pointwise(groups: list[Group]) -> list[Group]:
    """Groups of layers that do not normalize (DyT) joined to the group of norms trained beside them: their settings
    differ in the layer's own (alpha_init, no eps), so each joins the one group of norms whose other settings are
    equal, where no other such group matches it (two DyT settings in one group would pass for replicates); any
    other stays a group of its own."""
    norms, pointwise = defaultdict(list), defaultdict(list)
    for group in groups:
        others = {k: v for k, v in group.settings.items() if not k.startswith(LAYER_SETTINGS)}
        normalizes = any(r.variant.normalizes for r in group.runs)
        (norms if normalizes else pointwise)[json.dumps(others, sort_keys=True, default=str)].append(group)
    joined = set()
    for key, found in pointwise.items():
        if len(found) == 1 and len(norms.get(key, [])) == 1:
            norms[key][0].runs += found[0].runs
            joined.add(id(found[0]))
    return [g for g in groups if id(g) not in joined]


def group_runs(runs: list[Run]) -> list[Group]:
    by_settings: dict[str, Group] = {}
    for run in runs:
        settings = comparison_settings(run.config)
        key = json.dumps(settings, sort_keys=True, default=str)
        by_settings.setdefault(key, Group(settings, [])).runs.append(run)
    groups = sorted(join_pointwise(list(by_settings.values())), key=lambda g: (g.model, g.runs[0].name))
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
