"""The verdict's tables from one set of objects: summary.md's numbers are the CSVs' (parsed back and compared, each at
its column's rounding), every row fits in 120 characters, the wandb run (offline) holds the same tables, and the
audit CSVs hold what the verdict is computed from (each validation's paired differences; each random direction's
values)."""

import csv
import json
import math
import re

import pytest

from normlab.study.report.verdict_tables import COMPARISON_COLUMNS, NORM_COLUMNS
from test_report import angles_with_direction_means, make_run, report, write_ablation, write_csv


@pytest.fixture
def reported(tmp_path):
    """Three seeds of LN and RMS (RMS ahead by 0.02, 0.03, 0.01) with validations along the way, angles with each
    random direction's mean, one ablation; reported with its wandb run (offline)."""
    sweep = tmp_path / "exp"
    for seed, (ln, rms) in enumerate([(3.00, 3.02), (3.10, 3.13), (3.05, 3.06)]):
        make_run(sweep, f"tiny-layernorm-seed{seed}", "layernorm", seed, ln)
        run = make_run(sweep, f"tiny-rmsnorm-seed{seed}", "rmsnorm", seed, rms)
        angles_with_direction_means(run, {"2.final_norm.input": 91.0}, seed)
        rows = [{"step": s - 1, "val/loss": 4 - s / 10} for s in (2, 4, 6, 8)] + [{"step": 9, "val/loss": rms}]
        write_csv(run / "metrics.csv", rows, ["step", "val/loss"])
        ln_rows = [{"step": s - 1, "val/loss": 4 - s / 10 - 0.01 * seed} for s in (2, 4, 6, 8)]
        write_csv(sweep / f"tiny-layernorm-seed{seed}" / "metrics.csv", ln_rows + [{"step": 9, "val/loss": ln}],
                  ["step", "val/loss"])
    write_ablation(sweep / "tiny-rmsnorm-seed0", 0.0123, 0.0100, 0.0146)
    report(f"runs={sweep}", f"out={tmp_path / 'out'}", wandb=True)
    return tmp_path / "out"


def markdown_rows(summary: str, header: str) -> list[list[str]]:
    block = summary.split(header + "\n")[1].split("\n\n")[0].splitlines()[1:]  # less the separator
    return [line[2:-2].split(" | ") for line in block]


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def shown(column, row: dict) -> str:
    """The CSV's value(s) of `column`, formatted as the markdown shows them."""
    def one(text: str):
        if text == "":
            return "—"
        try:
            value = int(text) if re.fullmatch(r"-?\d+", text) else float(text)
        except ValueError:
            return text
        return column.number(value)

    values = [one(row[key]) for key in column.keys]
    if len(values) == 2:
        return "—" if "—" in values else f"[{values[0]}, {values[1]}]"
    return values[0]


@pytest.mark.parametrize("name, columns", [("verdict_comparisons", COMPARISON_COLUMNS),
                                           ("verdict_norms", NORM_COLUMNS)])
def test_every_number_of_the_verdict_tables_is_its_csvs_and_every_row_fits(reported, name, columns):
    summary = (reported / "summary.md").read_text()
    header = "| " + " | ".join(c.header for c in columns) + " |"
    cells = markdown_rows(summary, header)
    rows = read_csv(reported / f"{name}.csv")
    assert len(cells) == len(rows) > 0
    for markdown, row in zip(cells, rows):
        assert markdown == [shown(c, row) for c in columns]
    table = [line for line in summary.splitlines() if line.startswith("| ") and (
        line == header or any(line.startswith(f"| {r['model']} |") for r in rows))]
    assert max(len(line) for line in table) <= 120 and len(header) <= 120


def test_the_csv_keeps_full_precision_and_what_the_tables_round(reported):
    (row,) = read_csv(reported / "verdict_comparisons.csv")
    # differences 0.02, 0.03, 0.01: mean 0.02, se 0.01 / sqrt 3, 2 df; alone in its family
    assert float(row["mean"]) == pytest.approx(0.02, abs=1e-12)
    assert float(row["ci_high"]) - 0.02 == pytest.approx(4.302652729 * 0.01 / math.sqrt(3), rel=1e-8)
    assert (row["sim_low"], row["sim_high"]) == (row["ci_low"], row["ci_high"])  # a family of one
    assert [float(v) for v in row["per_seed"].split()] == pytest.approx([0.02, 0.03, 0.01])
    assert row["sign_test_p"] == "0.25" and row["family_size"] == "1"


def test_the_audit_csvs_hold_each_validation_and_each_random_direction(reported):
    validations = read_csv(reported / "loss_by_validation.csv")
    assert [int(r["step"]) for r in validations] == [2, 4, 6, 8, 10]
    for r in validations[:4]:  # RMS 4 - s/10, LN the same less 0.01 x seed
        assert [float(v) for v in r["per_seed"].split()] == pytest.approx([0.0, 0.01, 0.02])
        assert float(r["mean"]) == pytest.approx(0.01)
    angles = [r for r in read_csv(reported / "angles_by_site.csv") if r["norm"] == "rmsnorm"
              and r["site"] == "final_norm.input"]
    assert len(angles) == 3 and all(len(r["null_random_means_deg"].split()) == 39 for r in angles)


def test_the_wandb_run_holds_the_verdict_tables_as_the_csvs_do(reported):
    (run,) = (reported / "wandb").glob("offline-run-*")
    assert list(run.glob("*.wandb"))
    for name in ("verdict_comparisons", "verdict_norms"):
        (table,) = run.glob(f"files/media/table/report/{name}_*.table.json")
        logged = json.loads(table.read_text())
        rows = read_csv(reported / f"{name}.csv")
        assert logged["columns"] == list(rows[0])
        for values, row in zip(logged["data"], rows):
            for column, value in zip(logged["columns"], values):
                expected = row[column]
                if isinstance(value, float):
                    assert value == pytest.approx(float(expected), rel=1e-12)
                else:
                    assert ("" if value is None else str(value)) == expected
    assert not [p for p in (reported / "wandb").rglob("*") if p.is_symlink()]
