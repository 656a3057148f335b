"""The sections of summary.md below the verdict, as markdown: per group of runs its runs (parameters, steps, speed,
why a run is left out), the paired final validation loss, the paired evaluation and the angle to 1 per layer; per
pretrained model its angles per layer; and the figures under each section."""

import json
import math
import statistics

from omegaconf import OmegaConf

from normlab.probe.profiles import profile, runs_text, site_sort, site_tick, step_text
from normlab.study.report.branches import branch_section
from normlab.study.report.contrasts import Contrast, complete_blocks, sign_along_training
from normlab.study.report.groups import Group, Series
from normlab.study.report.intervals import Interval
from normlab.study.report.pretrained import Pretrained
from normlab.study.report.render import Column, Table, markdown, text_columns
from normlab.study.report.runs import BIGRAM_MARGIN, LEARNED_MARGIN, Run
from normlab.study.report.verdict import DEMO_MODELS, DEMO_NOTE, replacements, seeds_text
from normlab.training.rundir.tables import step_ranges


def parameter_count(config: dict, cache: dict) -> int:
    key = json.dumps([config["model"], config["norm"]], sort_keys=True, default=str)
    if key not in cache:
        import torch

        from normlab.training.pipeline import build_model

        with torch.device("meta"):
            cache[key] = build_model(OmegaConf.create(config)).num_params()
    return cache[key]


RUN_COLUMNS = text_columns("run", "norm", "seed", "parameters", "step", "final val loss", "below unigram",
                           "below bigram", "tokens/s (median)", "status", right=(2, 3, 4, 5, 6, 7, 8))


def margin(bar: float | None, loss: float) -> str:
    """How far a final loss lies below a bar (nats/token; > 0: below it)."""
    return f"{bar - loss:+.4f}" if bar is not None and math.isfinite(loss) else "—"


def runs_table(group: Group, parameters: dict) -> str:
    rows = []
    for run in sorted(group.runs, key=lambda r: (r.norm.order, r.seed, r.name)):
        rates = [v for _, v in run.metrics.get("train/tokens_per_sec", [])[1:]]  # the first includes warm-up
        rows.append({
            "run": run.name, "norm": group.label(run.norm), "seed": run.seed,
            "parameters": f"{parameter_count(run.config, parameters):,}",
            "step": f"{run.val_step or 0:,}" + (f" of {run.max_steps:,}" if run.max_steps else ""),
            "final val loss": f"{run.final_val_loss:.4f}" if math.isfinite(run.final_val_loss) else "—",
            "below unigram": margin(run.unigram_loss, run.final_val_loss),
            "below bigram": margin(run.bigram_loss, run.final_val_loss),
            "tokens/s (median)": f"{statistics.median(rates):,.0f}" if rates else "—",
            "status": f"**{run.left_out}**" if run.left_out else "compared" + (f"; {run.note}" if run.note else "")})
    return markdown(Table("runs", RUN_COLUMNS, tuple(rows)))


COMPARISON_CAPTION = (
    "Δ: the final validation loss of the first-named norm minus the other's, a seed's pair per row (nats/token; — : "
    "no pair of that seed); its intervals, Holm p, sign test and detectable effect are the verdict's.")


def comparison_table(group: Group, members: list[Contrast]) -> str:
    """Each comparison of the group as a member of the report's family (contrasts.py): a column of its difference
    per seed and their mean, and below, its sign along the second half (the verdict gives its intervals and tests)."""
    if not group.comparisons:
        return "No pair to compare: the group needs a centred and an uncentred finished run of one seed.\n"
    compared = [m for m in members if m.group is group and m.comparison is not None]
    by_seed = [{base.seed: d for (base, _), d in zip(m.comparison.pairs, m.comparison.differences)} for m in compared]
    seeds = sorted({seed for found in by_seed for seed in found})
    labels = [m.comparison.label for m in compared]
    columns = text_columns("seed", *labels, right=tuple(range(len(labels) + 1)))
    rows = [{"seed": seed, **{label: m.interval.number(found[seed]) if seed in found else "—"
                              for label, m, found in zip(labels, compared, by_seed)}} for seed in seeds]
    rows.append({"seed": "mean", **{label: m.interval.number(m.interval.mean) for label, m in zip(labels, compared)}})
    along = " ".join(f"{m.comparison.label}: {sign_along_training(m.comparison)}." for m in compared)
    caption = (f"{COMPARISON_CAPTION} Along the second half of training, the mean Δ over seeds at each validation "
               f"(loss_by_validation.csv): {along}")
    return markdown(Table("comparisons", columns, tuple(rows), caption))


def factorial_table(group: Group, members: list[Contrast]) -> str:
    """The 2x2 of centring and bias, where the group's 2x2 is complete: each cell's mean final loss over the seeds
    all four cells have; its effects (contrasts.factorial) are the verdict's rows, named here as they read."""
    blocks = complete_blocks(group)
    effects = [m for m in members if m.group is group and m.effect]
    if not blocks or not effects:
        return ""
    names = {cell: group.label(arm) for cell, arm in group.cells.items()}

    def mean(cell) -> str:
        return f"{names[cell]}: {statistics.fmean(b[cell] for b in blocks.values()):.4f}"

    cells = [{"bias": bias, "centred": mean((True, with_bias)), "uncentred": mean((False, with_bias))}
             for bias, with_bias in (("with", True), ("without", False))]
    named = "; ".join(f"{m.label}: {m.interval.number(m.interval.mean)}" for m in effects)
    return markdown(Table("cells", text_columns("bias", "centred", "uncentred"), tuple(cells), (
        f"The cells: mean final loss over the {seeds_text(len(blocks))} every cell has (each seed a block: same "
        f"initial weights, same batches). Their effects, the verdict's (2x2) rows with their intervals and tests: "
        f"{named} (> 0: the first-named side has the higher loss).")))


def final_loss_note(group: Group) -> str:
    """What the group's final losses are, where its learning rate then was, and the learning check's yardstick: of
    the runs compared (an unfinished run's last validations are earlier; its row says so), else of every run."""
    measured = [r for r in group.runs if r.final_validations]
    runs = [r for r in measured if not r.left_out] or measured
    if not runs:
        return ""
    steps = sorted({s for r in runs for s, _ in r.final_validations})
    fractions = [f for r in runs if (f := lr_fractions(r, r.final_validations[0][0])) is not None]
    lr = (f", while the learning rate went from {fraction_range([f[0] for f in fractions])}x its peak to "
          f"{fraction_range([f[1] for f in fractions])}x" if fractions else "")
    shared = all([s for s, _ in r.final_validations] == steps for r in runs)  # else each step that any run has
    where = (f"step {steps[0]:,}" if len(steps) == 1 else f"from step {steps[0]:,} to {steps[-1]:,}" if shared
             else f"steps {step_ranges(steps)}")
    text = (f"Final val loss: the mean of a run's last {len(runs[0].final_validations)} validation"
            f"{'s' * (len(runs[0].final_validations) > 1)} ({where}){lr}.")
    return text + learning_check_text(group) + "\n"


def learning_check_text(group: Group) -> str:
    """The bars a compared run passed (learning_check): each one's held-out cross-entropy and margin."""
    if group.unigram_loss is None:
        return " Learning check: not made (the runs' prepared data, data.dir, is not there)."
    bars = (f"the held-out split's cross-entropy is {group.unigram_loss:.4f} nats/token under the training split's "
            "token frequencies" + (f", {group.bigram_loss:.4f} under its count bigram model (data/bigram.py)"
                                   if group.bigram_loss is not None else ""))
    below_unigram = sum(r.learned is False for r in group.runs)
    below_bigram = sum(r.beyond_bigrams is False and not r.left_out for r in group.runs)  # compared all the same
    if group.learning_check == "off":
        return (f" Learning check: off (learning_check=false): every run is compared, {below_unigram} of "
                f"{len(group.runs)} not {LEARNED_MARGIN} below token frequencies' loss; {bars}.")
    if group.learning_check == "unigram" or group.bigram_loss is None:
        return (f" Learning check: {bars}; a run whose final loss is not {LEARNED_MARGIN} below token frequencies' "
                "learned them and nothing else, and is compared with nothing"
                + (f" ({below_bigram} of {len(group.runs)} runs compared all the same although not {BIGRAM_MARGIN} "
                   "below the bigram model's: learning_check=unigram)." if group.bigram_loss is not None else "."))
    return (f" Learning check: {bars}; a run whose final loss is not {BIGRAM_MARGIN} below the bigram model's did "
            "no more than a table of which token follows which, and is compared with nothing.")


def lr_fractions(run: Run, step: int) -> tuple[float, float] | None:
    """The learning rate at the validation after `step` optimizer steps (its last value logged before: rows are
    logged at step - 1) and at the run's last logged step (metrics.csv's lr-* column), as fractions of its peak: the
    schedule's, optimizer.lr, where the config gives it (a branch logs its lr from step K on, past the peak), else the
    largest logged."""
    column = next((k for k in sorted(run.metrics) if k.startswith("lr-")), None)
    series = run.metrics.get(column, [])
    declared = (run.config.get("optimizer") or {}).get("lr")
    peak = declared if isinstance(declared, (int, float)) and declared > 0 else max((v for _, v in series), default=0)
    if not series or peak <= 0:
        return None
    at_step = [v for s, v in series if s < step] or [series[0][1]]
    return at_step[-1] / peak, series[-1][1] / peak


def fraction_range(values: list[float]) -> str:
    """0.12, or 0.10-0.11 where the runs differ at two decimals."""
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return low if low == high else f"{low}-{high}"


def evaluation_values(run: Run) -> dict[tuple[str, str], tuple[int, float]]:
    """(task, metric) -> (step, value) of a run's normlab-eval rows, at the newest step evaluated."""
    values = {}
    for row in sorted(run.evaluation, key=lambda r: r["step"]):
        if row["value"] is not None:
            values[(row["task"], row["metric"])] = (row["step"], row["value"])
    return values


def evaluation_table(group: Group) -> str:
    """Per comparison, task and metric of normlab-eval: uncentred minus centred (or one norm minus the other it is
    compared with), paired by seed, with its t interval."""
    columns = text_columns("comparison", "task", "metric", "pairs (seeds)", "steps", "difference per seed", "mean",
                           "95% CI (t)", "excludes 0", right=(6,))
    rows = []
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
            rows.append(dict(zip((col.keys[0] for col in columns), (
                c.label, task, metric, f"{i.n} ({', '.join(str(s) for s, _, _ in found)})", steps,
                ", ".join(f"{d:+.4f}" for d in differences), f"{i.mean:+.4f}", ci, excludes))))
    if not rows:
        return ""
    return markdown(Table("evaluation", columns, tuple(rows))) + (
        "\nSteps: the checkpoints of a pair's runs, the subtracted norm's/the other's (each the newest in its "
        "eval/results.csv).\n")


def layer_table(series: list[Series]) -> str:
    """Per norm input, two tables of a column per norm: the angle to 1 (mean over seeds ± their sd) with its
    deviation in null sds, and the share of the squared norm along 1; the steps and runs in the caption."""
    profiles = [(s, profile(s.angles, "input", "uniform")) for s in series]
    profiles = [(s, p) for s, p in profiles if p]
    if not profiles:
        return ""
    keys = sorted({k for _, p in profiles for k in p}, key=site_sort)
    titles = ["input"] + [s.norm for s, _ in profiles]
    columns = tuple(Column((i,), title, right=i > 0) for i, title in enumerate(titles))

    def cell(point, share: bool) -> str:
        if point is None:
            return "—"
        if share:
            return f"{point.share:.4f}"
        spread = f" ± {point.seed_sd:.2f}" if point.seed_sd is not None else ""
        return f"{point.mean:.2f}{spread} ({point.deviation:+.1f}{'' if point.random_sd is not None else '‡'})"

    def rows(share: bool) -> tuple:
        return tuple(dict(enumerate([site_tick(k), *(cell(p.get(k), share) for _, p in profiles)])) for k in keys)

    measured = {s.norm: f"at step {step_text([p])}, {runs_text(len(s.angles))}" for s, p in profiles}
    measured = (f"each norm {next(iter(measured.values()))}" if len(set(measured.values())) == 1
                else "; ".join(f"{norm} {text}" for norm, text in measured.items()))
    d = profiles[0][1][keys[0]].d if keys[0] in profiles[0][1] else None
    null = (f" (a random direction's share averages 1/d = {1 / d:.4f}, but their spread is wide: the verdict gives the "
            "percentile among them)") if d else ""
    return (markdown(Table("layers", columns, rows(share=False), (
        f"θ (z): the angle (°) of a norm's input to 1, mean over the runs' mean angles ± their sd ({measured}); z, "
        "(θ − 90) in sds of that mean angle over random directions in place of 1 (‡: of a mean over independent "
        "tokens, where angles.csv has no null)."))) + "\n" + markdown(Table("layer_shares", columns, rows(share=True), (
            f"The share of the squared norm along 1: the mean cos² of the angle{null}; per run and direction in "
            "angles_by_site.csv."))))


def group_section(group: Group, parameters: dict, members: list[Contrast]) -> str:
    text = [f"## {group.title}\n"]
    if group.model in DEMO_MODELS:
        text.append(f"*{DEMO_NOTE}.*\n")
    text += ["### Runs\n", runs_table(group, parameters), final_loss_note(group),
             "### Final validation loss, paired by seed\n", comparison_table(group, members)]
    text += branch_section(group)
    if table := factorial_table(group, members):
        text += ["### Centring × bias, paired by seed\n", table]
    if table := evaluation_table(group):
        text += [f"### Evaluation (normlab-eval), uncentred − centred{replacements(group.comparisons)}, paired by "
                 "seed\n", table]
    if table := layer_table(group.series()):
        text += ["### Angle to 1 at the norm inputs, per layer: θ (z), then the share along 1\n", table]
    return "\n".join(text)


def pretrained_section(model: Pretrained) -> str:
    return "\n".join([f"## {model.name} (pretrained, {model.norm or 'norm not recorded'}; {model.csv})\n",
                      layer_table(model.series())])


def images(figures: list[str]) -> str:
    return "".join(f"\n![{f}]({f})\n" for f in figures) + "\n"
