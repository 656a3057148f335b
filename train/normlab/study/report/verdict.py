"""The verdict: the primary contrasts in words, the two tables of numbers (verdict_tables.py: the family of
comparisons, the norms' angles, shares and ablations), each norm in words below them, its footnotes and how to read
it."""

from collections import defaultdict
from dataclasses import dataclass

from normlab.probe.extremes import Unavailable, extremes
from normlab.probe.profiles import Point, last_step, profile, runs_text, site_tick
from normlab.probe.shares import ShareExtremes, share_extremes
from normlab.study.report.contrasts import Contrast, primary_of
from normlab.study.report.groups import Group, Series, last_rows
from normlab.study.report.intervals import Interval
from normlab.study.report.pretrained import Pretrained
from normlab.study.report.render import markdown
from normlab.study.report.runs import BIGRAM_MARGIN, LEARNED_MARGIN, along_1, null_rows
from normlab.study.report.verdict_tables import AblationNull, comparison_table, norm_table, null_of

DEMO_MODELS = ("tiny",)
DEMO_NOTE = "demo scale: not evidence about the paper's models"


def seeds_text(count: int) -> str:
    return f"{count} seed{'s' * (count != 1)}"


def step_note(steps: set[int], row_steps: set[int]) -> str:
    """Where a cell's numbers come from another step than its row's loss: say which."""
    return "" if not steps or steps <= row_steps else f" (step {', '.join(f'{s:,}' for s in sorted(steps))})"


def sign_changes(per_seed: list[list[dict]]) -> str:
    """Which single sites' ablation deltas change sign between seeds (a mean over seeds hides it)."""
    by_site: dict[str, list[float]] = defaultdict(list)
    for rows in per_seed:
        for row in rows:
            if row["site"] != "all" and row.get("delta") is not None:
                by_site[row["site"]].append(row["delta"])
    compared = {site: deltas for site, deltas in by_site.items() if len(deltas) == len(per_seed)}
    changed = sorted(site for site, deltas in compared.items() if min(deltas) < 0 < max(deltas))
    if not compared:
        return ""
    if not changed:
        return f"; one sign in every seed at each of {len(compared)} sites"
    named = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    return f"; sign changes between seeds at {len(changed)} of {len(compared)} sites ({named})"


def ablation_cell(series: Series, command: str, row_steps: set[int] = frozenset()) -> str:
    """Per ablation kind, the delta at every norm at once: one seed's with its bootstrap interval (and unit); over
    several seeds the mean with a t interval over the seeds, each seed's delta and interval, and the sites whose
    delta changes sign between seeds; each with its percentile among the null's random directions where it was run."""
    runs = defaultdict(list)  # per ablation kind: (label, the row of site all, the run's rows, its null by direction)
    for label, rows in zip(series.labels, series.ablations):
        newest = last_rows(rows)
        for row in along_1(newest):
            if row["site"] == "all" and row.get("delta") is not None:
                kind = row.get("ablation") or ""
                of_kind = [r for r in newest if (r.get("ablation") or "") == kind]
                null = {r["direction"]: r["delta"] for r in null_rows(of_kind) if r.get("delta") is not None}
                runs[kind].append((label, row, along_1(of_kind), null))
    if not runs:
        return f"not run ({command})"
    cells = []
    for kind, found in sorted(runs.items()):
        prefix = f"{kind if series.normalizes else f'{kind} (before its point-wise map)'}: " if kind else ""
        steps = step_note({row["step"] for _, row, *_ in found if row.get("step") is not None}, set(row_steps))
        among = null_text(null_of([row["delta"] for _, row, *_ in found], [n for *_, n in found]))
        units = {resampling_unit(row) for _, row, *_ in found if row.get("ci_low") is not None}
        per_seed = [f"{label} {bootstrap_text(row, with_unit=len(units) > 1)}"
                    f"{null_text(null_of([row['delta']], [n]), short=True)}" for label, row, _, n in found]
        per_seed_unit = f" (bootstrap over {units.pop()})" if len(units) == 1 else ""
        if len(found) == 1:
            cells.append(f"{prefix}{bootstrap_text(found[0][1])}{steps}{among}")
            continue
        interval = Interval.of([row["delta"] for _, row, *_ in found])
        cells.append(f"{prefix}{interval.text(seeds_text(interval.n))}{steps}{among}; per seed{per_seed_unit}: "
                     f"{', '.join(per_seed)}"
                     f"{sign_changes([rows for _, _, rows, _ in found])}")
    missing = sum(1 for rows in series.ablations if not rows)
    return "; ".join(cells) + (f"; {runs_text(missing)} not ablated" if missing > 0 else "")


def null_text(null: AblationNull | None, short: bool = False) -> str:
    """Where the along-1 delta falls among the null's random directions' deltas."""
    if null is None:
        return ""
    if short:
        return f" (pct {null.percentile:.0f})"
    return (f", at the {null.percentile:.0f}th percentile of the same ablation along {null.directions} random "
            f"directions (their median {null.median:+.4f})")


def resampling_unit(row: dict) -> str:
    return row.get("resampling_unit") or "windows"


def bootstrap_text(row: dict, with_unit: bool = True) -> str:
    """One run's delta with its bootstrap interval and (unless said once for several) the unit it resampled."""
    if row.get("ci_low") is None or row.get("ci_high") is None:
        return f"{row['delta']:+.4f}"
    unit = f" (bootstrap over {resampling_unit(row)})" if with_unit else ""
    return f"{row['delta']:+.4f} [{row['ci_low']:+.4f}, {row['ci_high']:+.4f}]{unit}"


@dataclass(frozen=True)
class AngleCells:
    """The verdict's angle and share cells of a norm, and what their footnotes need to know."""
    deviation: str
    share: str
    measured_null: bool = True  # False: the null of independent tokens (‡)
    no_max_null: str = ""  # why the largest of the sites is compared with +-2 only (§), "" where it is not
    no_share_null: str = ""  # why there is no sign-invariant statistic nor share percentile (¶), "" where there is


def threshold_text(threshold: float | None) -> str:
    return f"5% threshold {threshold:.1f}" if threshold is not None else "too few directions for a 5% threshold"


def sign_invariant_text(shares: ShareExtremes | Unavailable) -> str:
    """The mean cos^2 along 1, each seed against its own random directions, combined over seeds (probe.shares)."""
    if isinstance(shares, Unavailable):
        return "sign-invariant: unavailable¶"
    return (f"sign-invariant, mean cos² along 1 (Stouffer over {runs_text(shares.runs)}): {shares.z_max:+.1f} at "
            f"{site_tick(shares.site)}, largest of {shares.sites} sites: p {shares.p_max:.3f} "
            f"({threshold_text(shares.threshold)})")


def share_cell(points: dict[tuple, Point], shares: ShareExtremes | Unavailable) -> str:
    """The largest share along 1 over the sites (seed average), with its percentile among the random directions'
    shares at that site where angles.csv has them."""
    key, point = max(points.items(), key=lambda item: item[1].share)
    if isinstance(shares, Unavailable):
        return f"{point.share:.4f} ({site_tick(key)}; 1/d = {1 / point.d:.4f}; no percentile¶)"
    return (f"{point.share:.4f} ({site_tick(key)}): percentile {shares.percentile[key]:.1f} of {shares.directions} "
            f"random directions' shares there (their median {shares.null_median[key]:.4f}; 1/d = {1 / point.d:.4f})")


def angle_cells(series: Series, row_steps: set[int] = frozenset()) -> AngleCells:
    """At the norm inputs: the site whose mean angle to 1 lies farthest from 90 (seed level), against the null of the
    largest of all sites (probe.extremes), and the most extreme single run, corrected for its choice among the runs;
    beside it the sign-invariant statistic on the mean cos^2 (probe.shares); the largest share along 1, placed among
    random directions' shares."""
    points = profile(series.angles, "input", "uniform")
    if not points:
        return AngleCells("no angles.csv", "—")
    shares = share_extremes(series.angles, series.labels)
    share_text, no_share_null = share_cell(points, shares), getattr(shares, "reason", "")
    steps = step_note({s for p in points.values() for s in p.steps}, set(row_steps))
    found = extremes(series.angles, series.labels)
    if isinstance(found, Unavailable):  # the largest deviation in null sds, as before the per-direction means
        key, point = max(points.items(), key=lambda item: abs(item[1].deviation))
        measured = all(p.random_sd is not None for p in points.values())
        deviation = (f"{point.deviation:+.1f} ({site_tick(key)}, {point.mean:.2f}°){'' if measured else '‡'}§, "
                     f"largest of {len(points)} sites{steps}; {sign_invariant_text(shares)}")
        return AngleCells(deviation, share_text, measured, found.reason, no_share_null)
    level = found.seed_level
    deviation = (f"signed: {level.z_max:+.1f} at {site_tick(level.site)} ({points[level.site].mean:.2f}°), largest "
                 f"of {level.sites} sites: p {level.p_max:.3f} ({threshold_text(level.threshold)}; "
                 f"{level.directions} directions){steps}")
    if len(found.runs) > 1:
        label, run = found.extreme_run
        deviation += (f"; most extreme run: {label}, {run.z_max:+.1f} at {site_tick(run.site)} (p {run.p_max:.3f} "
                      f"for one run; {found.extreme_run_p:.3f} for the most extreme of {len(found.runs)}, Šidák)")
    return AngleCells(f"{deviation}; {sign_invariant_text(shares)}", share_text, no_share_null=no_share_null)


def replacements(comparisons: list) -> str:
    """' (dyt, scalenorm: − layernorm)': the comparisons of one norm in place of another, by the norm each is
    compared with ('' where there is none): what a table of uncentred − centred holds beside it."""
    against: dict[str, list[str]] = defaultdict(list)
    for c in comparisons:
        if not c.centring and not c.role and c.other not in against[c.base]:
            against[c.base].append(c.other)
    shown = "; ".join(f"{', '.join(others)}: − {base}" for base, others in against.items())
    return f" ({shown})" if shown else ""


ROUNDING_NOTE = ("one seed: its difference includes the rounding noise of this CPU's kernels, amplified over "
                 "training (make demo's moves by 0.011 between two CPUs), which only seeds average out")


def loss_cell(member: Contrast) -> str:
    """One comparison of the family: its label (which says when the bias differs too), the mean over seeds with its
    t interval and Holm-adjusted twin (bold "excludes 0" only when the adjusted one does), the exact sign test of its
    seeds and the smallest difference its seeds could detect."""
    interval = member.interval
    if interval.low is None:
        return f"{member.label}: {interval.text()}; {ROUNDING_NOTE}"
    verdict = "**excludes 0 after Holm**" if interval.holm_excludes_zero else (
        "excludes 0 alone, not after Holm" if interval.excludes_zero else "includes 0")
    return (f"{member.label}: {interval.text(f'{seeds_text(interval.n)}, {interval.df} df')}, "
            f"{interval.simultaneous_text()}: {verdict}; {member.sign_text()}; 80% power after Holm at "
            f"{interval.detectable_text()}")


def primary_text(members: list[Contrast]) -> str:
    """The primary contrast of each group (analysis.primary, declared with the runs), or why it has none."""
    lines = []
    for group in {id(m.group): m.group for m in members}.values():
        primary = next((m for m in members if m.group is group and m.primary), None)
        name = primary_of(group)
        if primary is not None:
            lines.append(f"Primary contrast of {group.title} (analysis.primary={name}, declared with the runs before "
                         f"they trained; every other comparison is secondary): {loss_cell(primary)} "
                         f"({primary.method}).")
        elif name:
            needs = ("an uncentred branch and the centred one of the same sources, finished"
                     if group.branch_step is not None and name == "centring"
                     else "all four norms of the centring × bias 2x2 with 2 or more seeds in each")
            lines.append(f"Primary contrast of {group.title} (analysis.primary={name}): not estimable here, as it "
                         f"needs {needs}.")
    family_size = sum(m.interval.p is not None for m in members)
    lines.append(f"The family: {family_size} comparison{'' if family_size == 1 else 's'} with an interval, "
                 "Holm-adjusted together (the verdict's loss cells, the factorial's effects, the comparison tables).")
    return "".join(f"{line}\n\n" for line in lines)


def did_not_learn_text(group: Group, arm) -> str | None:
    """Why a norm none of whose runs learned more than token frequencies (Run.learned), or under learning_check=bigram
    more than a bigram table (Run.beyond_bigrams), is compared with nothing."""
    runs = [r for r in group.runs if r.norm == arm]
    if not runs or group.learning_check == "off":
        return None
    losses = sorted(r.final_val_loss for r in runs)
    span = f"final val loss {losses[0]:.4f}-{losses[-1]:.4f}"
    why = ("its ablation not read: the output of a model that ignores its input ignores that input's mean too, so a Δ "
           "of 0 says nothing of centring")
    if all(r.learned is False for r in runs):
        return (f"did not learn: {span}, not {LEARNED_MARGIN} below {group.unigram_loss:.4f} (the held-out "
                f"cross-entropy of token frequencies alone): left out of every comparison; {why}")
    if group.learning_check == "bigram" and all(r.beyond_bigrams is False for r in runs):
        return (f"no better than bigrams: {span}, not {BIGRAM_MARGIN} below {group.bigram_loss:.4f} (the held-out "
                "cross-entropy of a count bigram model): left out of every comparison")
    return None


def detail_lines(group: Group, cells: list[AngleCells]) -> list[str]:
    """The group's norms in words below the verdict's tables (each seed's ablation, the most extreme run, the
    sites whose ablation changes sign); the angle cells of each go to `cells` too (for the footnotes)."""
    lines = []
    model = f"{group.title}†" if group.model in DEMO_MODELS else group.title
    for arm in group.arms():
        runs, s = group.compared(arm), group.series_of(arm)
        if not runs:
            if text := did_not_learn_text(group, arm):
                lines.append(f"- {model}, {group.label(arm)}: {text}.")
            continue
        steps = sorted({r.val_step for r in runs})
        angles = angle_cells(s, set(steps))
        cells.append(angles)
        ablation = ablation_cell(s, f"normlab-ablate model_path={runs[0].dir}", set(steps))
        lines.append(f"- {model}, {s.norm} ({runs_text(len(runs))}, step {', '.join(f'{x:,}' for x in steps)}): "
                     f"angles: {angles.deviation}. Share along 1: {angles.share}. Ablation: {ablation}.")
    if not lines and (left_out := [r for r in group.runs if r.left_out]):
        lines.append(f"- {model}: nothing compared: {runs_text(len(left_out))} left out (see below).")
    return lines


def pretrained_line(model: Pretrained, cells: list[AngleCells]) -> str:
    (s,) = model.series()
    step = last_step(model.angles)
    angles = angle_cells(s, {step})
    cells.append(angles)
    source = next((r.get("source") for r in model.angles if r.get("source")), "<the model's directory>")
    ablation = ablation_cell(s, f"normlab-ablate model_path={source}", {step})
    return (f"- {model.name} (pretrained), {s.norm} (step {step:,}; no loss comparison): angles: {angles.deviation}. "
            f"Share along 1: {angles.share}. Ablation: {ablation}.")


HOW_TO_READ = """\
How to read it. The runs of a model differ only in the norm and the seed, and the runs of one seed start from the
same weights and see the same batches; a run's final loss is the mean of its last validations
(analysis.final_validations). An interval that excludes 0 says the mean difference over seeds is unlikely to be 0,
not that every seed agrees (>0 says that); one that includes 0 says these seeds cannot tell, not that the norms are
equal. The ablation asks whether a trained model relies on its centring (or would tolerate one); it does not say
whether centring helped training, which is the loss's question. Every number of the tables is in
verdict_comparisons.csv and verdict_norms.csv at full precision; docs/report.md defines each.
"""


def verdict(groups: list[Group], pretrained: list[Pretrained], members: list[Contrast]) -> tuple[str, str, list]:
    """The primary contrasts, the verdict's two tables (verdict_tables.py) with their captions, each norm in words
    below them, and the footnotes; `members`: the family of comparisons (contrasts.family). (text, footnotes,
    tables)."""
    cells: list[AngleCells] = []
    details = [line for g in groups for line in detail_lines(g, cells)]
    details += [pretrained_line(m, cells) for m in pretrained]
    tables = ([comparison_table(members)] if members else []) + [norm_table(groups, pretrained)]
    primary = primary_text(members) if members else ""
    text = primary + "\n".join(markdown(t) for t in tables)
    if details:
        text += "\nEach norm in words (per seed, the most extreme run, where signs differ):\n\n"
        text += "\n".join(details) + "\n"
    return text, footnotes(groups, cells), tables


def pointwise_layers(groups: list[Group]) -> list[str]:
    """The norms compared that divide their input by no statistic of it (DyT)."""
    return sorted({s.norm for g in groups for s in g.series() if not s.normalizes})


def footnotes(groups: list[Group], cells: list[AngleCells]) -> str:
    notes = []
    if any(g.model in DEMO_MODELS for g in groups):
        notes.append(f"† {DEMO_NOTE}.")
    both = {c.label: c for g in groups for c in g.comparisons if c.centring and c.bias is None}
    for label, c in sorted(both.items()):
        with_bias, without = (c.base, c.other) if c.base_traits.bias else (c.other, c.base)
        notes.append(f"{label}: these runs differ in the bias as well as in the centring ({with_bias} has a bias β, "
                     f"{without} none), so the difference is not the centring's alone. The sweep "
                     "norm=layernorm,rmsnorm,layernorm_nobias,rmsnorm_bias separates the two (its centring × bias "
                     "table below the verdict).")
    if replaced := sorted({c.label for g in groups for c in g.comparisons if not c.centring and not c.role}):
        notes.append(f"{'; '.join(replaced)}: one norm in place of another, so the loss cell can support a difference "
                     "in everything the norm does (whether their mean final loss over seeds differs, at this size and "
                     "step), not the centring's effect, which only the uncentred − centred rows measure.")
    if steps := sorted({g.branch_step for g in groups if g.branch_step is not None}):
        notes.append(f"Branches of step{'s' * (len(steps) > 1)} {', '.join(f'{k:,}' for k in steps)} (docs/branch.md): "
                     "each arm starts at step K from its source's checkpoint of K, computing the source's function, "
                     "its optimizer restarted alike in every arm (branch.moments: fresh, or the source's moments kept "
                     "where a weight is unchanged) and the source's batches and schedule from K on. Uncentred − "
                     "centred is the centring's work from K on; the control computes the LayerNorm function in an "
                     "RMSNorm model, so its distance from the LayerNorm branch is float rounding through training, the "
                     "floor for the first; the LayerNorm branch − its source continuing is what the restart costs (a "
                     "head untied at K included), which every arm pays alike.")
    if pointwise := pointwise_layers(groups):
        notes.append(f"{', '.join(pointwise)}: no norm, a point-wise layer (it divides its input by no statistic of "
                     "it); its ablation centres its inputs before its point-wise map.")
    if any(not c.measured_null for c in cells):
        notes.append("‡ null sd of a mean over independent tokens, (180/π)/√d/√count: these angles.csv files "
                     "have no null_random_std_deg (the spread of the mean angle over random directions). Tokens of "
                     "a text are not independent, so this null is far too narrow and these deviations are overstated: "
                     "measure again with the current normlab-angles for the right null.")
    if reasons := sorted({c.no_max_null for c in cells if c.no_max_null}):
        notes.append("§ the largest of the sites in null sds with no null of the largest (of S sites, one exceeds ±2 "
                     "by chance far more often than 5% of the time; a seed average is divided by one run's null "
                     f"sd): {'; '.join(reasons)}.")
    if reasons := sorted({c.no_share_null for c in cells if c.no_share_null}):
        notes.append("¶ no sign-invariant statistic nor share percentile (they need each random direction's mean "
                     f"cos², null_random_cos2 of angles.csv): {'; '.join(reasons)}.")
    return "".join(f"{n}\n\n" for n in notes)
