"""normlab-report runs=[RUN_OR_SWEEP_DIR,...] csvs=[HF_ANGLES.csv,...]: the answer of a set of runs to "does
LayerNorm's mean subtraction do any work?", as tables (summary.md) and figures (PDF and PNG, 300 dpi).

Runs are grouped by their whole resolved config less what does not shape the comparison (the seed, the norm, names,
paths, loggers, devices: `comparison_settings`); within a group, the runs of two norms (a norm: its name and its
layer's settings; what it is: what its class says, model.norms.traits) of the same seed form a pair (same initial
weights, same batches), and the paired differences of their final validation loss (the mean of their last
analysis.final_validations) give a t-based 95% confidence interval; the four norms of a complete centring x bias 2x2
are one factorial blocked by seed, and every comparison is a member of one family, Holm-adjusted (contrasts.py). A run
whose final loss is not clearly below its data's held-out cross-entropy under a count bigram model (or, with
learning_check=unigram, under token frequencies alone) is compared with
nothing. Which norms are compared is declared (conf/report.yaml): the centring x bias 2x2 among the norms whose class
says it is of it (LayerNorm, RMSNorm, with and without a bias) and every other norm (DyT, a user's) against the
`reference` norm, or the `pairs` given. Unfinished runs (by their checkpoints' steps), runs whose final validation
loss is not finite or missing, and replicates (the same norm, settings and seed as another) are shown and flagged,
never compared; `.replaced-*` folders (restart=true) are skipped, and folders of a model without training metrics
(normlab-convert's) listed. Values that are not finite numbers are left out of every number, each file's named in a
warning. Angles come from each run's angles.csv at its last measured step, ablations from its ablation.csv
(normlab-ablate). Pretrained models enter as the CSVs of normlab-angles (and normlab-ablate). docs/report.md says how
to read every table and figure.

The package: runs.py reads run directories, pretrained.py the CSVs of pretrained models, groups.py groups and pairs
the runs, intervals.py holds the paired statistics and contrasts.py the family of comparisons (the 2x2 factorial,
Holm), verdict_tables.py the verdict's two tables as rows of numbers, render.py writes a table to markdown, CSV and
wandb, verdict.py and tables.py write summary.md's text and tables, numbers.py the runs' numbers as CSV, figures.py
draws the figures (the per-layer one with training's angle callback: normlab/probe/figure.py), dashboard.py logs the
tables and figures to wandb; here, the command.
"""

from pathlib import Path

import matplotlib.pyplot as plt
from omegaconf import DictConfig, OmegaConf

from normlab.common import outputs
from normlab.probe.figure import DPI, save
from normlab.probe.table import AnalysisError
from normlab.study.report.contrasts import family, intervals_of
from normlab.study.report.dashboard import log_report, project_of
from normlab.study.report.figures import STYLE, draw_group, draw_pretrained, tuning_figure
from normlab.study.report.groups import LEARNING_CHECKS, Declared, group_runs, slug
from normlab.study.report.numbers import write_numbers
from normlab.study.report.pretrained import load_pretrained
from normlab.study.report.render import markdown, write_csv
from normlab.study.report.runs import find_runs, untrained_runs
from normlab.study.report.tables import group_section, images, pretrained_section
from normlab.study.report.tuning import centring_change_table, centring_table, choices_table, points_table, tune
from normlab.study.report.verdict import HOW_TO_READ, verdict

COMMAND = "normlab-report"


def check_declared(declared: Declared, runs: list) -> None:
    """Refuse a reference or pairs that name a norm no run has (without a reference named, the norms outside the
    2x2 are compared with its centred norm with a bias, or with nothing where no run has one)."""
    names = sorted({r.norm.name for r in runs})
    known = f"the runs' norms: {', '.join(names)}" if names else "no run given"
    unknown = sorted({n for pair in declared.pairs for n in pair if n not in names})
    if unknown:
        raise AnalysisError(f"pairs names {', '.join(unknown)}, which no run has ({known}): give "
                            "pairs=[[a,b],...] of the runs' norm names")
    if declared.reference is not None and declared.reference not in names:
        raise AnalysisError(f"reference={declared.reference}: no run has that norm ({known})")


def report(paths: list[Path], out: Path, csvs: list[Path] = (), declared: Declared = Declared(),
           figures: bool = True, to_wandb: bool = False) -> None:
    """The report of the runs at or under `paths` and the CSVs `csvs` into `out`; `figures`: draw them too;
    `to_wandb`: log its tables and figures to a run of the study's wandb project (dashboard.py)."""
    for path in paths:
        if not path.exists():
            raise AnalysisError(f"{path} does not exist: give run directories, or directories holding runs")
    # new, empty, or an earlier report holding only what it wrote (its marker), which it replaces: outputs.py
    outputs.check_folder(out, COMMAND, owned_in_run=("report",))
    runs, replaced = find_runs(paths)
    untrained = untrained_runs(paths)
    pretrained = load_pretrained(list(csvs))
    if not runs and not pretrained:
        first = untrained[0][0] if untrained else None
        hint = (f": {first} has no training metrics (a run of normlab-convert, say); give the CSV of "
                f"`normlab-angles model_path={first}` as csvs=[...]") if first else ""
        raise AnalysisError(f"no run (metrics.csv + config.yaml) under {', '.join(map(str, paths))}{hint}")
    if declared.tuning:
        return tuning_report(runs, out, declared.tuning, figures, to_wandb)
    check_declared(declared, runs)
    groups = group_runs(runs, declared)  # each run's norm class answers here, before anything is written
    members = family(groups)
    table, notes, verdict_tables = verdict(groups, pretrained, members)
    head = f"# normlab report\n\n## Verdict\n\n{table}\n{notes}{HOW_TO_READ}\n"
    if replaced:
        head += "Skipped (runs moved aside by restart=true): " + ", ".join(f"`{p}`" for p in replaced) + "\n\n"
    if untrained:
        head += "Left out, with no training metrics (metrics.csv) to compare:\n" + "".join(
            f"- `{p}`: {what}; its angles enter as a pretrained model's: `normlab-angles model_path={p}`, then that "
            "CSV in csvs=[...]\n" for p, what in untrained) + "\n"
    parameters: dict = {}
    sections = [group_section(g, parameters, members) for g in groups] + [pretrained_section(m) for m in pretrained]
    # the tables are ready: a failure before this point writes nothing, one after it leaves the old report whole
    with outputs.staged_folder(out, COMMAND) as staging, plt.rc_context(STYLE):
        drawn = ([draw_group(g, staging, intervals_of(members, g)) for g in groups]
                 + [draw_pretrained(m, staging) for m in pretrained] if figures else [[] for _ in sections])
        (staging / "summary.md").write_text(head + "".join(t + images(f) for t, f in zip(sections, drawn)))
        tables = [write_csv(t, staging) for t in verdict_tables] + write_numbers(staging, groups, pretrained, members)
        mode = log_report(staging, verdict_tables, project_of([r.config for r in runs]),
                          f"report-{out.resolve().name}") if to_wandb else None
    count = sum(len(f) for f in drawn)
    what = f"{count} figures (PDF and PNG, {DPI} dpi)" if figures else "no figures (figures=false)"
    logged = f"; logged to wandb ({mode}: {out / 'wandb'})" if mode else ""
    print(table + f"\nwrote summary.md, {what} and its numbers ({', '.join(tables)}) to {out}{logged}")


def tuning_report(runs: list, out: Path, key: str, figures: bool, to_wandb: bool) -> None:
    """The tuning of `key` (tuning.py): each norm's best value and whether it lies inside the grid, every value's
    loss, a figure per group, the two tables as CSV and on wandb."""
    if not runs:
        raise AnalysisError(f"tuning={key} needs training runs (metrics.csv + config.yaml), not pretrained CSVs")
    tunings = tune(runs, key)
    if not any(t.points for t in tunings):
        raise AnalysisError(f"no run under the runs given has a finished final loss at a numeric {key}: "
                            f"tuning= names the dotted config key swept (optimizer.lr)")
    tables = [choices_table(tunings), points_table(tunings), centring_table(tunings), centring_change_table(tunings)]
    left_out = "".join(f"- `{run}`: {why}\n" for t in tunings for run, why in t.left_out)
    text = (f"# normlab report: the tuning of {key}\n\n## Each norm's best\n\n{markdown(tables[0])}\n"
            f"## Every value\n\n{markdown(tables[1])}\n" + (f"Left out:\n{left_out}\n" if left_out else "")
            + (f"## The centring at each value\n\n{markdown(tables[2])}\n" if tables[2].rows else "")
            + (f"## The centring from one value to the next\n\n{markdown(tables[3])}\n" if tables[3].rows else ""))
    with outputs.staged_folder(out, COMMAND) as staging, plt.rc_context(STYLE):
        drawn = [(t, tuning_figure(t)) for t in tunings] if figures else []
        names = [n for n in (save(fig, staging, f"tuning_{slug(t.title)}") for t, fig in drawn) if n]
        (staging / "summary.md").write_text(text + images(names))
        written = [write_csv(t, staging) for t in tables]
        mode = log_report(staging, tables, project_of([r.config for r in runs]),
                          f"report-{out.resolve().name}") if to_wandb else None
    logged = f"; logged to wandb ({mode}: {out / 'wandb'})" if mode else ""
    print(markdown(tables[0]) + f"\nwrote summary.md, {len(names)} figures and {', '.join(written)} to {out}{logged}")


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
    out = Path(str(cfg.out)) if cfg.out else (paths[0] if paths else csvs[0].parent) / "report"
    figures, to_wandb = cfg.get("figures", True), cfg.get("wandb", True)
    for name, value in (("figures", figures), ("wandb", to_wandb)):
        if not isinstance(value, bool):
            raise AnalysisError(f"{name}={value}: give true or false")
    report(paths, out, csvs, declared(cfg), figures, to_wandb)


def declared(cfg: DictConfig) -> Declared:
    """The comparisons of `reference` and `pairs` ([[a,b],...], norm names)."""
    pairs = OmegaConf.to_container(cfg.pairs) if OmegaConf.is_list(cfg.get("pairs")) else cfg.get("pairs") or []
    if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(n, str) for n in p) and p[0] != p[1]
            for p in pairs):
        raise AnalysisError(f"pairs={pairs}: give [[a,b],...], each two norms' names, compared as b − a")
    seen = {}
    for a, b in pairs:  # one comparison named twice would count twice in the Holm family
        if (twin := seen.get(frozenset((a, b)))) is not None:
            raise AnalysisError(f"pairs names the comparison of {a} and {b} twice ({twin} and [{a},{b}]): give each "
                                "pair once (b − a and a − b are one comparison, its sign turned)")
        seen[frozenset((a, b))] = f"[{a},{b}]"
    tuned = OmegaConf.to_container(cfg.tuned) if OmegaConf.is_list(cfg.get("tuned")) else cfg.get("tuned") or []
    if not isinstance(tuned, list) or not all(isinstance(k, str) and k for k in tuned):
        raise AnalysisError(f"tuned={tuned}: give [key,...], the dotted config keys tuned per norm, e.g. "
                            "[optimizer.lr]")
    check = cfg.get("learning_check", "bigram")
    check = "off" if check is False else check  # learning_check=false, as the command line gives it
    if check not in LEARNING_CHECKS:
        raise AnalysisError(f"learning_check={check}: give bigram (compare runs below a count bigram model's loss), "
                            "unigram (below token frequencies') or false (compare every run: smoke runs)")
    tuning = cfg.get("tuning")
    if tuning is not None and (not isinstance(tuning, str) or not tuning.strip()):
        raise AnalysisError(f"tuning={tuning}: give the dotted config key that was swept per norm, e.g. optimizer.lr")
    reference = cfg.get("reference")
    return Declared(None if reference is None else str(reference), tuple(tuple(p) for p in pairs), tuple(tuned),
                    check, tuning)
