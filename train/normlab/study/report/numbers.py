"""The report's numbers as CSV beside summary.md, so that anyone can audit it without rerunning: every run (runs.csv),
every paired comparison's difference at every validation (loss_by_validation.csv), the angle to 1 and its null at
every norm site of every compared run and pretrained model at its last measured step, with each random direction's
mean angle and mean cos² (angles_by_site.csv: the uniform reference, all positions), and every ablation row
(ablations.csv); for groups of branches, every comparison's paired difference at every validation from K
(branch_losses.csv) and every arm's share along 1 at every measured step from K (branch_shares.csv). The verdict's
tables are written beside them by render.py."""

import csv
from pathlib import Path

from normlab.probe.profiles import per_direction, site_tick
from normlab.study.report.branches import differences_from_k, shares_from_k
from normlab.study.report.contrasts import Contrast
from normlab.study.report.groups import Group, last_rows
from normlab.study.report.pretrained import Pretrained

# each random direction's mean angle and mean cos²: what the largest-of-sites statistics are computed from
PER_DIRECTION = ("null_random_means_deg", "null_random_cos2")
ANGLE_COLUMNS = ("step", "layer", "site", "count", "mean_deg", "std_deg", "mean_cos2", "null_random_mean_deg",
                 "null_random_std_deg", "null_directions", "d", *PER_DIRECTION)
ABLATION_COLUMNS = ("step", "ablation", "direction", "site", "layer", "role", "windows", "tokens", "loss",
                    "ablated_loss", "delta", "ci_low", "ci_high", "resampling_unit", "share_along_1", "null_percentile")


def write(path: Path, columns: list[str], rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)


def run_rows(groups: list[Group]) -> list[dict]:
    return [{"group": g.title, "run": r.name, "norm": g.label(r.norm), "seed": r.seed, "step": r.val_step,
             "max_steps": r.max_steps, "final_val_loss": r.final_val_loss,
             "final_validation_steps": " ".join(str(s) for s, _ in r.final_validations),
             "unigram_loss": r.unigram_loss, "learned": r.learned, "bigram_loss": r.bigram_loss,
             "beyond_bigrams": r.beyond_bigrams, "status": r.left_out or "compared", "note": r.note}
            for g in groups for r in sorted(g.runs, key=lambda r: (r.norm.order, r.seed, r.name))]


def validation_rows(members: list[Contrast]) -> list[dict]:
    """Every paired comparison's difference at every validation step all its runs logged: per seed and the mean."""
    rows = []
    for m in members:
        if m.comparison is None:
            continue
        steps, differences = m.comparison.validation_differences()
        for step, *per_seed in zip(steps, *differences):
            rows.append({"group": m.group.title, "comparison": m.label, "step": step, "seeds": len(per_seed),
                         "per_seed": " ".join(f"{d:.9g}" for d in per_seed), "mean": sum(per_seed) / len(per_seed)})
    return rows


def angle_rows(groups: list[Group], pretrained: list[Pretrained]) -> list[dict]:
    measured = [(g.title, g.label(r.norm), r.name, r.seed, r.angles) for g in groups for r in g.runs if not r.left_out]
    measured += [(m.name, m.norm, m.name, "", m.angles) for m in pretrained]
    return [{"group": group, "norm": norm, "run": run, "seed": seed, **row,
             **{k: " ".join(f"{v:.9g}" for v in per_direction(row, k) or []) for k in PER_DIRECTION}}
            for group, norm, run, seed, angles in measured for row in last_rows(angles)
            if row.get("reference") == "uniform" and row.get("position") in ("all", None)]


def ablation_rows(groups: list[Group], pretrained: list[Pretrained]) -> list[dict]:
    measured = [(g.title, g.label(r.norm), r.name, r.seed, r.ablation) for g in groups for r in g.runs]
    measured += [(m.name, m.norm, m.name, "", m.ablation) for m in pretrained]
    return [{**row, "group": group, "norm": norm, "run": run, "seed": seed}  # the report's names of the run
            for group, norm, run, seed, rows in measured for row in rows]


def branch_loss_rows(groups: list[Group]) -> list[dict]:
    return [{"group": g.title, "branch_step": g.branch_step, "comparison": c.label, "step": d.step, "seeds": i.n,
             "per_seed": " ".join(f"{v:.9g}" for v in d.per_seed), "mean": i.mean, "ci_low": i.low, "ci_high": i.high}
            for g in groups if g.branch_step is not None for c in g.comparisons
            for d in differences_from_k(c) for i in [d.interval]]


def branch_share_rows(groups: list[Group]) -> list[dict]:
    return [{"group": g.title, "branch_step": g.branch_step, "arm": s.norm, "step": x.step, "runs": x.runs,
             "mean_share": x.mean_share, "largest_site": site_tick(x.site), "largest_share": x.largest,
             "percentile": x.percentile, "null_median_share": x.null_median, "z": x.z, "p_max": x.p_max}
            for g in groups if g.branch_step is not None for s in g.series() for x in shares_from_k(s, g.branch_step)]


def write_numbers(folder: Path, groups: list[Group], pretrained: list[Pretrained],
                  members: list[Contrast]) -> list[str]:
    """The four CSVs into `folder`; their names."""
    identity = ["group", "norm", "run", "seed"]
    tables = {
        "runs.csv": (["group", "run", "norm", "seed", "step", "max_steps", "final_val_loss", "final_validation_steps",
                      "unigram_loss", "learned", "bigram_loss", "beyond_bigrams", "status", "note"], run_rows(groups)),
        "loss_by_validation.csv": (["group", "comparison", "step", "seeds", "per_seed", "mean"],
                                   validation_rows(members)),
        "angles_by_site.csv": (identity + list(ANGLE_COLUMNS), angle_rows(groups, pretrained)),
        "ablations.csv": (identity + list(ABLATION_COLUMNS), ablation_rows(groups, pretrained)),
    }
    if any(g.branch_step is not None for g in groups):  # groups of branches (docs/branch.md), from their step K
        tables["branch_losses.csv"] = (["group", "branch_step", "comparison", "step", "seeds", "per_seed", "mean",
                                        "ci_low", "ci_high"], branch_loss_rows(groups))
        tables["branch_shares.csv"] = (["group", "branch_step", "arm", "step", "runs", "mean_share", "largest_site",
                                        "largest_share", "percentile", "null_median_share", "z", "p_max"],
                                       branch_share_rows(groups))
    for name, (columns, rows) in tables.items():
        write(folder / name, columns, rows)
    return list(tables)
