"""Groups, pairs and the paired comparisons: runs grouped by their comparison settings (everything but the norm, the
seed and what only names, places, logs or speeds up a run); in a group, the runs of each norm (its identity: its name
and its layer's settings) paired by seed with those of another as declared (conf/report.yaml): the centring x bias
2x2 among the norms whose class says it is of it, every other norm against the reference norm, or the pairs given;
and the series of angle and ablation rows each norm contributes to the tables and figures."""

import hashlib
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING

from normlab.common.run_identity import identifies_the_run
from normlab.probe.figure import AngleSeries
from normlab.probe.profiles import last_step
from normlab.probe.table import AnalysisError
from normlab.study.report.intervals import Interval
from normlab.study.report.runs import BIGRAM_MARGIN, CONTINUING, CONTROL, LEARNED_MARGIN, Arm, Run, with_sources
from normlab.training.rundir.config import flat, is_off

if TYPE_CHECKING:
    from normlab.model.norms import Traits

LAYER_SETTINGS = "norm.layer."  # the layer's own: eps for a norm, alpha_init for DyT
NORM_CHOICES = ("_target_", "bias")  # of the layer's settings, those that tell the norms of a group apart
PAIRING_KEYS = ("seed", "data.seed", "branch.source")  # the source: a branch's pairing (Run.pairing), not its group
# learning_check's values: a compared run's final loss must lie clearly below a count bigram model's (and so below
# token frequencies' too), only below token frequencies', or nothing (smoke runs of a few steps, which learned nothing)
LEARNING_CHECKS = ("bigram", "unigram", "off")
ARM_KEYS = ("branch.zero_mean_writers",)  # part of the arm a run is (runs.CONTROL), not of its group


@dataclass(frozen=True)
class Declared:
    """The comparisons a report is told to make (conf/report.yaml): each pair (a, b) of `pairs` as b − a; without
    pairs, the centring x bias 2x2 and every other norm against `reference` (a norm's name); `tuned`: settings each
    norm was tuned in (optimizer.lr), in which the runs of one group may differ by norm; `reference` None: the 2x2's
    centred norm with a bias (LayerNorm), whichever class that is."""
    reference: str | None = None
    pairs: tuple[tuple[str, str], ...] = ()
    tuned: tuple[str, ...] = ()
    learning_check: str = "bigram"  # which bar a compared run must pass (LEARNING_CHECKS)
    tuning: str | None = None  # a setting swept per norm (optimizer.lr): the report is its tuning (tuning.py)

    def is_tuned(self, key: str) -> bool:
        return any(key == k or key.startswith(f"{k}.") for k in self.tuned)


def comparison_settings(config: dict) -> dict:
    """What shapes a run's result besides its norm and seed: the resolved config less the settings that only name,
    place, log or speed up a run (run_identity.NOT_IDENTITY: experiment and run names, paths, loggers, devices, ...),
    less seed and norm but for its layer's settings other than its class and bias (eps; a DyT's alpha_init); paths
    inside the run directory are written <run_dir>, and the sequences an optimizer step sees stand for the devices. A
    model size or learning rate of its own makes a group of its own."""
    run_dir = str(config.get("run_dir") or "\0")
    settings = {}
    for key, value in flat(config).items():
        if not identifies_the_run(key) or key in PAIRING_KEYS or key in ARM_KEYS:
            continue
        if key.startswith("norm.") and (not key.startswith(LAYER_SETTINGS) or key.rsplit(".", 1)[-1] in NORM_CHOICES):
            continue
        settings[key] = value.replace(run_dir, "<run_dir>") if isinstance(value, str) else value
    trainer, data = config.get("trainer") or {}, config.get("data") or {}
    devices = [trainer.get(k) if isinstance(trainer.get(k), int) else 1 for k in ("devices", "num_nodes")]
    settings["sequences per optimizer step"] = config.get("global_batch_size") or (
        (data.get("batch_size") or 0) * devices[0] * devices[1])
    return settings


BRANCH_ROLES = {  # a branch group's comparisons beside the centring's (docs/branch.md): what each measures
    "control": "the control: float rounding alone",  # the LayerNorm function in an RMSNorm model
    "restart": "the restart's cost",  # the LN branch, its optimizer restarted, against its source continuing
}


@dataclass(frozen=True)
class Comparison:
    """`other` − `base` final validation loss, paired by seed. `centring`: uncentred − centred, two norms of the 2x2
    (the centring's effect, with or without a bias, or with the bias differing too); else one norm in place of the
    other (`base` the reference, or the first of a declared pair): everything the norm does."""
    base: str  # the norms' labels
    other: str
    base_traits: "Traits"
    other_traits: "Traits"
    pairs: list[tuple[Run, Run]]  # (base, other)
    tuned: dict[str, tuple] = field(default_factory=dict)  # a tuned setting the norms differ in: (base's, other's)
    role: str = ""  # of a branch group (BRANCH_ROLES): what `other` − `base` measures there; "" the norms' difference

    @property
    def centring(self) -> bool:
        base, other = self.base_traits, self.other_traits
        return not self.role and base.centring_pair and other.centring_pair and base.centres and not other.centres

    @property
    def bias(self) -> bool | None:  # None: the two norms differ in the bias too
        return self.base_traits.bias if self.base_traits.bias == self.other_traits.bias else None

    @property
    def replacement(self) -> str:
        """What `other` is in `base`'s place, by what its class says it is."""
        if not self.other_traits.normalizes:
            return "a point-wise layer"
        return "another norm" if self.base_traits.normalizes else "a norm"

    @property
    def label(self) -> str:
        if self.role:
            return f"{self.other} − {self.base} ({BRANCH_ROLES[self.role]})"
        tuned = "".join(f"; each at its tuned {k}: {base} and {other}" for k, (base, other) in self.tuned.items())
        if self.centring:
            bias = "the bias differs too" if self.bias is None else "with bias" if self.bias else "without bias"
            return f"{self.other} − {self.base} ({bias}{tuned})"
        bias = "; the bias differs too" if self.bias is None else "" if self.bias else ", both without bias"
        return f"{self.other} − {self.base} ({self.replacement} in place of {self.base}{bias}{tuned})"

    @cached_property
    def interval(self) -> Interval:
        """The paired t interval over the seeds (the family's member, contrasts.py, holds the one the report shows:
        pooled for a simple effect of a complete 2x2, with its simultaneous interval)."""
        return Interval.of(self.differences)

    @property
    def differences(self) -> list[float]:
        return [o.final_val_loss - b.final_val_loss for b, o in self.pairs]

    def validation_differences(self) -> tuple[list[int], list[list[float]]]:
        """The validation steps (optimizer steps done) that every run of the comparison logged, and per pair (seed)
        other − base validation loss at each of them."""
        losses = [[dict(run.metrics.get("val/loss", [])) for run in pair] for pair in self.pairs]
        logged = sorted(set.intersection(*[set(loss) for pair in losses for loss in pair])) if losses else []
        return [s + 1 for s in logged], [[other[s] - base[s] for s in logged] for base, other in losses]


@dataclass
class Series(AngleSeries):
    """What one norm contributes to a figure or a verdict row: the angle and ablation rows of its compared runs
    (seeds), or of one pretrained model."""
    ablations: list[list[dict]]  # per run
    labels: list[str]  # per run: "seed 0", or the model
    normalizes: bool = True  # False: a point-wise layer (DyT), whose ablation centres the input of its map


def last_rows(rows: list[dict]) -> list[dict]:
    """The rows of a table at its newest step."""
    at = last_step(rows)
    return [r for r in rows if r.get("step") == at]


@dataclass(frozen=True)
class Group:
    """Runs whose comparison settings are equal: they differ only in norm and seed. Data, built once by group_runs:
    each run screened (its reason where it is left out, screen), the comparisons its norms make (pair)."""
    settings: dict
    runs: tuple[Run, ...]
    slug: str = ""  # in the names of its figures
    distinct: str = ""  # the settings that set it apart from the report's other groups
    comparisons: tuple[Comparison, ...] = ()
    cells: dict[tuple[bool, bool], Arm] = field(default_factory=dict)  # the 2x2's norms by (centres, bias)
    tuned: tuple[str, ...] = ()  # the declared tuned settings its norms differ in
    learning_check: str = "bigram"  # the bar its compared runs passed (Declared.learning_check)

    @property
    def model(self) -> str:
        return self.runs[0].model

    @property
    def branch_step(self) -> int | None:
        """K, where the group's runs are branches of step K (docs/branch.md); else None."""
        return self.settings.get("branch.step")

    @property
    def unigram_loss(self) -> float | None:
        """The held-out split's unigram cross-entropy under the training split's token frequencies (nats/token): a
        run whose final validation loss is not clearly below it learned token frequencies and nothing else."""
        return next((r.unigram_loss for r in self.runs if r.unigram_loss is not None), None)

    @property
    def bigram_loss(self) -> float | None:
        """The held-out split's cross-entropy under a count bigram model of the training split (nats/token): a run
        whose final loss is not clearly below it did no more than a table of which token follows which."""
        return next((r.bigram_loss for r in self.runs if r.bigram_loss is not None), None)

    @property
    def title(self) -> str:
        return f"{self.model}" + (f" ({self.distinct})" if self.distinct else "")

    def arms(self) -> list[Arm]:
        return arms_of(self.runs)

    def label(self, arm: Arm) -> str:
        return arm_label(self.arms(), arm)

    def compared(self, arm: Arm) -> list[Run]:
        return [r for r in self.runs if r.norm == arm and not r.left_out]

    def series_of(self, arm: Arm) -> Series:
        runs = self.compared(arm)
        return Series(self.label(arm), [r.angles for r in runs], [r.ablation for r in runs],
                      [f"seed {r.seed}" for r in runs], arm.traits.normalizes, style=arm.style)

    def series(self) -> list[Series]:
        return [self.series_of(a) for a in self.arms() if self.compared(a)]


def arms_of(runs) -> list[Arm]:
    return sorted({r.norm for r in runs}, key=lambda a: a.order)


def arm_label(arms: list[Arm], arm: Arm) -> str:
    """The norm's name; where another norm of the group has that name too, with the layer settings that differ
    ("layernorm bias=False", a run of norm.layer.bias=false beside layernorm's)."""
    namesakes = [a.settings for a in arms if a.name == arm.name]
    differing = sorted({k for s in namesakes for k in s if k != "_partial_"
                        and any(o.get(k, "absent") != s.get(k, "absent") for o in namesakes)})
    label = " ".join([arm.name, *(f"{k}={arm.settings.get(k, 'absent')}" for k in differing)])
    return f"{label} ({arm.variant})" if arm.variant else label


def tuned_settings(runs, declared: Declared) -> tuple[str, ...]:
    """The declared tuned settings the norms of these runs differ in; each norm at one value of each (its tuned
    one), else one line."""
    values: dict[str, dict[Arm, set]] = defaultdict(lambda: defaultdict(set))
    for run in runs:
        for key, value in flat(run.config).items():
            if declared.is_tuned(key):
                values[key][run.norm].add(json.dumps(value, default=str))
    differing = []
    for key, by_norm in values.items():
        for arm, found in by_norm.items():
            if len(found) > 1:
                raise AnalysisError(f"norm {arm.name} has runs at {key} = {' and '.join(sorted(found))} in one "
                                    f"group: tuned={list(declared.tuned)} compares each norm at one setting; give "
                                    "the runs of its chosen setting alone")
        if len({v for found in by_norm.values() for v in found}) > 1:
            differing.append(key)
    return tuple(differing)


@dataclass(frozen=True)
class Screening:
    """The runs of a group as screened: each with its reason where it is left out (Run.left_out), and per norm
    the compared run of each pairing (seed)."""
    runs: tuple[Run, ...]
    kept: dict[Arm, dict[tuple, Run]]


def screen(runs, learning_check: str) -> Screening:
    """Runs without a final loss to compare (Run.incomplete: unfinished, ...), runs that did not learn more than
    token frequencies (Run.learned) or, under learning_check=bigram, no more than a bigram table (Run.beyond_bigrams),
    and replicates (the same norm and seed as another, the furthest trained kept) left out, each with its reason."""
    kept: dict[Arm, dict[tuple, Run]] = defaultdict(dict)
    screened = {}
    for run in sorted(runs, key=lambda r: (-(r.val_step or 0), r.name)):
        reason = ""
        if run.incomplete:
            reason = f"{run.incomplete}: left out"
        elif run.learned is False and learning_check != "off":
            reason = (f"did not learn: its final val loss {run.final_val_loss:.4f} is not {LEARNED_MARGIN} below "
                      f"{run.unigram_loss:.4f}, the held-out cross-entropy of token frequencies alone: left out of "
                      "every comparison")
        elif run.beyond_bigrams is False and learning_check == "bigram":
            reason = (f"no better than bigrams: its final val loss {run.final_val_loss:.4f} is not {BIGRAM_MARGIN} "
                      f"below {run.bigram_loss:.4f}, the held-out cross-entropy of a count bigram model: left out of "
                      "every comparison")
        elif run.pairing in kept[run.norm]:
            reason = f"same settings, norm and seed as {kept[run.norm][run.pairing].name}: a replicate, left out"
        screened[id(run)] = replace(run, left_out=reason) if reason else run
        if not reason:
            kept[run.norm][run.pairing] = run
    return Screening(tuple(screened[id(r)] for r in runs), dict(kept))


def pair(runs, kept: dict[Arm, dict[tuple, Run]], declared: Declared, branch_step: int | None,
         tuned: tuple[str, ...]) -> tuple[dict, list[Comparison]]:
    """The 2x2's cells and the comparisons, the runs of two norms paired by seed as declared: each of `pairs`, else
    the 2x2 (pair_centring) and every norm outside it against the reference; branches as pair_branches says."""
    arms, cells, comparisons = arms_of(runs), {}, []
    ordered = [a for a in arms if kept.get(a)]

    def compare(base: Arm, other: Arm, role: str = "") -> None:
        common = sorted(kept[base].keys() & kept[other].keys())
        if common:
            pairs = [(kept[base][p], kept[other][p]) for p in common]
            settings = [flat(run.config) for run in pairs[0]]
            differ = {k: (settings[0].get(k), settings[1].get(k)) for k in tuned
                      if settings[0].get(k) != settings[1].get(k)}
            comparisons.append(Comparison(arm_label(arms, base), arm_label(arms, other), base.traits, other.traits,
                                          pairs, differ, role))

    if branch_step is not None:
        pair_branches(ordered, cells, compare)
    elif declared.pairs:
        for first, second in declared.pairs:
            for base, other in [(b, o) for b in ordered for o in ordered if (b.name, o.name) == (first, second)]:
                compare(base, other)
    else:
        pair_centring(ordered, cells, compare)
        reference = (cells.get((True, True)) if declared.reference is None
                     else next((a for a in ordered if a.name == declared.reference), None))
        for other in [a for a in ordered if reference and a != reference and a not in cells.values()]:
            compare(reference, other)
    return cells, comparisons


def pair_centring(ordered: list[Arm], cells: dict, compare) -> None:
    """The centring x bias 2x2 among the norms whose class says it is of it (traits.centring_pair), a norm to a
    cell (another of the same traits is compared as any other norm): the centred and the uncentred norm of each
    bias setting (a 2x2 sweep gives two comparisons), else the one centred and the one uncentred norm there are
    (the paper's LayerNorm and RMSNorm: the bias differs too)."""
    for arm in ordered:
        if arm.traits.centring_pair:
            cells.setdefault((arm.traits.centres, arm.traits.bias), arm)
    matched = [((True, bias), (False, bias)) for bias in (True, False)
               if (True, bias) in cells and (False, bias) in cells]
    centred, uncentred = ([k for k in cells if k[0] == c] for c in (True, False))
    if not matched and len(centred) == 1 and len(uncentred) == 1:
        matched.append((centred[0], uncentred[0]))
    for base, other in matched:
        compare(cells[base], cells[other])


def pair_branches(ordered: list[Arm], cells: dict, compare) -> None:
    """The branches of one step K, paired by source and seed: the converted arm against the branch of its
    LayerNorm source's own norm (the centring's work from K on, as the 2x2 pairs it), the zero-mean-writers
    control against that branch (BRANCH_ROLES: rounding alone) and each branch of a source's own norm against
    its source continuing (what the optimizer's restart costs)."""
    trained = [a for a in ordered if not a.variant]
    pair_centring(trained, cells, compare)
    for arm in [a for a in ordered if a.variant == CONTROL]:
        if (centred := cells.get((True, arm.traits.bias))) is not None:
            compare(centred, arm, "control")
    for source in [a for a in ordered if a.variant == CONTINUING]:
        for kept in [a for a in trained if replace(a, variant=CONTINUING) == source]:
            compare(source, kept, "restart")


def unpaired_noted(runs: tuple[Run, ...], comparisons: list[Comparison]) -> tuple[Run, ...]:
    """The runs, a compared one that no comparison pairs noted so."""
    paired = {id(run) for c in comparisons for pair in c.pairs for run in pair}
    note = "no run of the other norm with its seed: in the angle tables, not in the loss comparison"
    return tuple(replace(r, note=note) if not r.left_out and id(r) not in paired else r for r in runs)


def present(settings: dict) -> dict:
    """The settings that set runs apart: a key at None or False is as if absent (run_config.is_off), so that a run
    written before normlab had it (branch.step) groups with one written since."""
    return {k: v for k, v in settings.items() if not is_off(v)}


def settings_key(settings: dict) -> str:
    return json.dumps(present(settings), sort_keys=True, default=str)


def join_layers(by_settings: list[tuple[dict, list[Run]]]) -> list[tuple[dict, list[Run]]]:
    """Groups whose settings are equal but for the norm layer's own (DyT's alpha_init and no eps, a user's norm's
    arguments) made one, where their norms' names all differ and at most one of them holds norms of the 2x2: DyT
    beside the LayerNorm and RMSNorm runs trained with it. Two settings of one norm (DyT's alpha_init, LayerNorm's
    eps) stay groups of their own, as do the groups beside them. (settings, runs) of each."""
    alike = defaultdict(list)
    for index, (settings, _) in enumerate(by_settings):
        others = {k: v for k, v in settings.items() if not k.startswith(LAYER_SETTINGS)}
        alike[settings_key(others)].append(index)
    joined, runs = set(), [list(r) for _, r in by_settings]
    for found in alike.values():
        names = [{a.name for a in arms_of(runs[i])} for i in found]
        of_2x2 = [i for i in found if any(a.traits.centring_pair for a in arms_of(runs[i]))]
        if len(found) > 1 and len(of_2x2) <= 1 and len(set().union(*names)) == sum(map(len, names)):
            home = (of_2x2 or found)[0]
            for index in [i for i in found if i != home]:
                runs[home] += runs[index]
                joined.add(index)
    return [(settings, runs[i]) for i, (settings, _) in enumerate(by_settings) if i not in joined]


def distinct_settings(settings: dict, others: list[dict]) -> str:
    """The settings that set a group apart from the others of its model (its title), four at most."""
    own, others = present(settings), [present(o) for o in others]
    differing = sorted(
        {k for o in others for k in own.keys() | o.keys() if own.get(k) != o.get(k)},
        key=lambda k: (k.startswith("callbacks."), k),  # callbacks last: mostly copies of other settings
    )
    shown = [f"{k}={settings.get(k, 'absent')}" for k in differing[:4]]
    return ", ".join(shown) + (f" and {len(differing) - 4} more" if len(differing) > 4 else "")


def slugs(found: list[tuple[dict, list[Run], str]]) -> list[str]:
    """The figures' name of each group (settings, runs, distinct): its model, set apart where the model has several
    groups by their one differing setting (branch.step=200), else by a hash of its settings."""
    names = []
    for settings, runs, distinct in found:
        same_model = [f for f in found if f[1][0].model == runs[0].model]
        if len(same_model) == 1:
            names.append(slug(runs[0].model))
            continue
        named = [slug(f"{runs[0].model}-{d}") for _, _, d in same_model]
        readable = len(set(named)) == len(named) and all("," not in d and len(d) <= 40 for _, _, d in same_model)
        digest = hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
        names.append(slug(f"{runs[0].model}-{distinct}") if readable else slug(f"{runs[0].model}-{digest[:8]}"))
    return names


def group_runs(runs: list[Run], declared: Declared = Declared()) -> list[Group]:
    """The runs grouped by their comparison settings, each group screened and paired (pure: the runs given are not
    changed; a group holds screened copies)."""
    by_settings: dict[str, tuple[dict, list[Run]]] = {}
    for run in runs:
        settings = {k: v for k, v in comparison_settings(run.config).items() if not declared.is_tuned(k)}
        by_settings.setdefault(settings_key(settings), (settings, []))[1].append(run)
    found = sorted(join_layers(list(by_settings.values())),
                   key=lambda f: (f[1][0].model, f[0].get("branch.step") or 0, f[1][0].name))  # branches by K
    found = [(s, with_sources(r) if s.get("branch.step") is not None else r) for s, r in found]
    described = [(s, r, distinct_settings(s, [o for o, other in found if other is not r
                                                and other[0].model == r[0].model])) for s, r in found]
    groups = []
    for (settings, members, distinct), name in zip(described, slugs(described)):
        tuned = tuned_settings(members, declared)
        screened = screen(members, declared.learning_check)
        cells, comparisons = pair(screened.runs, screened.kept, declared, settings.get("branch.step"), tuned)
        groups.append(Group(settings, unpaired_noted(screened.runs, comparisons), name, distinct, tuple(comparisons),
                            cells, tuned, declared.learning_check))
    return groups


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)
