"""normlab-report tuning=optimizer.lr on planted tuning sweeps whose answer is known: each norm's best value, whether
it lies inside the grid or at an end (then the advice to extend it that way), a diverged value ranked worst, the mean
and spread over seeds, the bigram margin of the best, the same numbers in summary.md and the CSVs, and bad input
refused in one line with nothing written."""

import csv
import math

import pytest

from normlab.probe.table import AnalysisError
from normlab.study.report.runs import find_runs
from normlab.study.report.tuning import HIGHEST, INSIDE, LOWEST, tune
from test_report import make_run, report, write_csv

GRID = (1e-3, 2e-3, 4e-3, 8e-3)
# LayerNorm's best inside the grid (4e-3); RMSNorm's still falling at its highest value (8e-3)
LOSSES = {"layernorm": (3.30, 3.10, 3.02, 3.08), "rmsnorm": (3.40, 3.20, 3.10, 3.05)}


def sweep(root, losses=LOSSES, grid=GRID, seeds=(0,)):
    for norm, values in losses.items():
        for lr, loss in zip(grid, values):
            for seed in seeds:
                make_run(root, f"tiny-{norm}-lr{lr:g}-seed{seed}", norm, seed, loss + seed / 100,
                         settings={"optimizer.lr": lr})


def diverge(run_dir):
    """Its last validation loss nan, as a run whose loss blew up logs it."""
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    rows[-1]["val/loss"] = "nan"
    write_csv(run_dir / "metrics.csv", rows, list(rows[0]))


def rows_of(path):
    return list(csv.DictReader(open(path)))


def test_each_norms_best_and_where_it_lies_in_the_grid(tmp_path):
    sweep(tmp_path / "tuning")
    (tuning,) = tune(find_runs([tmp_path / "tuning"])[0], "optimizer.lr")
    choices = {c.norm: c for c in tuning.choices}
    assert (choices["layernorm"].best, choices["layernorm"].where) == (4e-3, INSIDE)
    assert choices["layernorm"].final_val_loss == pytest.approx(3.02)
    assert choices["layernorm"].next_above == pytest.approx(0.06)  # 8e-3's 3.08, nearer than 2e-3's 3.10
    assert (choices["rmsnorm"].best, choices["rmsnorm"].where) == (8e-3, HIGHEST)
    assert choices["rmsnorm"].advice == "at the grid's highest: extend it above 0.008"
    assert choices["rmsnorm"].grid == GRID
    ln = [p for p in tuning.points if p.norm == "layernorm"]
    assert [p.best for p in ln] == [False, False, True, False]
    assert [p.above_best for p in ln] == pytest.approx([0.28, 0.08, 0.0, 0.06])

    falling = {"layernorm": (3.0, 3.1, 3.2, 3.3)}
    sweep(tmp_path / "low", falling)
    (low,) = tune(find_runs([tmp_path / "low"])[0], "optimizer.lr")
    assert (low.choices[0].where, low.choices[0].advice) == (LOWEST, "at the grid's lowest: extend it below 0.001")


def test_a_diverged_value_ranks_worst_and_the_extended_grid_puts_the_best_inside(tmp_path):
    """RMSNorm's grid extended above 8e-3: at 1.6e-2 it diverged, so 8e-3 lies inside, that neighbour infinitely worse;
    an unfinished run is left out of its value, with the reason."""
    root = tmp_path / "tuning"
    sweep(root)
    diverge(make_run(root, "tiny-rmsnorm-lr0.016-seed0", "rmsnorm", 0, 3.0, settings={"optimizer.lr": 1.6e-2}))
    make_run(root, "tiny-layernorm-lr0.016-seed0", "layernorm", 0, 2.0, steps=6, settings={"optimizer.lr": 1.6e-2})
    (tuning,) = tune(find_runs([root])[0], "optimizer.lr")
    rms = next(c for c in tuning.choices if c.norm == "rmsnorm")
    assert (rms.best, rms.where) == (8e-3, INSIDE) and rms.next_above == pytest.approx(0.05)  # 4e-3's, not 1.6e-2's
    diverged = next(p for p in tuning.points if p.value == 1.6e-2)
    assert diverged.final_val_loss == diverged.above_best == math.inf
    assert tuning.left_out == (("tiny-layernorm-lr0.016-seed0", "unfinished: step 6 of 10"),)
    assert next(c for c in tuning.choices if c.norm == "layernorm").grid == GRID  # 1.6e-2 not in its grid


def test_seeds_at_a_value_give_its_mean_and_spread(tmp_path):
    sweep(tmp_path / "tuning", seeds=(0, 1, 2))
    (tuning,) = tune(find_runs([tmp_path / "tuning"])[0], "optimizer.lr")
    point = next(p for p in tuning.points if p.norm == "layernorm" and p.value == 4e-3)
    assert point.final_val_loss == pytest.approx(3.03)  # 3.02, 3.03, 3.04
    assert point.seed_sd == pytest.approx(0.01) and point.seeds == (0, 1, 2)


def test_the_report_writes_the_choices_and_every_value_in_markdown_csv_and_a_figure(tmp_path, prepared):
    root = tmp_path / "tuning"
    sweep(root)
    report(f"runs={root}", f"out={tmp_path / 'out'}", "tuning=optimizer.lr", figures=True)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert summary.startswith("# normlab report: the tuning of optimizer.lr")
    assert "| layernorm | 0.004 | 3.0200 |" in summary
    assert "at the grid's highest: extend it above 0.008" in summary
    choices = {r["norm"]: r for r in rows_of(tmp_path / "out" / "tuning_choices.csv")}
    assert float(choices["layernorm"]["best"]) == 4e-3 and choices["rmsnorm"]["where"] == HIGHEST
    assert choices["layernorm"]["grid"] == "0.001 0.002 0.004 0.008"
    points = rows_of(tmp_path / "out" / "tuning.csv")
    planted = {v for values in LOSSES.values() for v in values}
    assert len(points) == 8 and {float(p["final_val_loss"]) for p in points} == planted
    assert (tmp_path / "out" / "tuning_tiny.png").stat().st_size > 10_000
    assert "![tuning_tiny.png](tuning_tiny.png)" in summary


def test_a_tuning_key_that_is_no_number_or_empty_is_refused_in_one_line(tmp_path):
    sweep(tmp_path / "tuning")
    with pytest.raises(AnalysisError, match="no run under the runs given has a finished final loss at a numeric "
                                            "model.name: tuning= names the dotted config key swept"):
        report(f"runs={tmp_path / 'tuning'}", f"out={tmp_path / 'out'}", "tuning=model.name")
    with pytest.raises(AnalysisError, match="tuning=: give the dotted config key"):
        report(f"runs={tmp_path / 'tuning'}", f"out={tmp_path / 'out'}", "tuning=''")
    assert not (tmp_path / "out").exists()


def test_the_centring_at_each_value_pairs_the_2x2s_norms_by_bias(tmp_path):
    """The 2x2 at two rates, planted: with a bias the uncentred norm is 0.02 worse at 2e-3 and 0.04 at 4e-3; without,
    0.00 and 0.02; averaged, 0.01 and 0.03. The report's table holds them; a group without a 2x2 pair has none."""
    losses = {"layernorm": (3.10, 3.00), "rmsnorm_bias": (3.12, 3.04), "layernorm_nobias": (3.11, 3.01),
              "rmsnorm": (3.11, 3.03)}
    sweep(tmp_path / "tuning", losses, grid=(2e-3, 4e-3))
    (tuning,) = tune(find_runs([tmp_path / "tuning"])[0], "optimizer.lr")
    found = {(c.value, c.bias): c.difference for c in tuning.centring()}
    assert found == pytest.approx({(2e-3, "with"): 0.02, (2e-3, "without"): 0.0, (2e-3, "averaged"): 0.01,
                                   (4e-3, "with"): 0.04, (4e-3, "without"): 0.02, (4e-3, "averaged"): 0.03})
    report(f"runs={tmp_path / 'tuning'}", f"out={tmp_path / 'out'}", "tuning=optimizer.lr")
    assert "| tiny | 0.004 | averaged | +0.0300 |" in (tmp_path / "out" / "summary.md").read_text()
    assert len(rows_of(tmp_path / "out" / "tuning_centring.csv")) == 6

    sweep(tmp_path / "paper", grid=(2e-3,), losses={"layernorm": (3.0,), "rmsnorm": (3.1,)})  # the bias differs too
    (paper,) = tune(find_runs([tmp_path / "paper"])[0], "optimizer.lr")
    assert paper.centring() == []


def test_the_centring_and_its_change_between_rates_are_paired_by_seed(tmp_path):
    """A study at two rates, planted: the bias arms at 4e-3 only (seeds 0-3), the arms without a bias at 2e-3 (seeds
    0-3) and 4e-3 (seeds 0-2). Without a bias the centring costs the uncentred norm 0.02 + 0.001 s at 2e-3 (seed s)
    and 0.05 + 0.002 s at 4e-3, so its change is 0.03 + 0.001 s over the seeds known at both (0-2): mean 0.031, sd
    0.001, a t interval of 0.031 ± 4.303 x 0.001 / sqrt 3. Each seed's own offset (0.3 s, in every arm) cancels."""
    root = tmp_path / "study"
    cells = {("layernorm", 4e-3): (3.00, 0.0), ("rmsnorm_bias", 4e-3): (3.01, 0.0),
             ("layernorm_nobias", 2e-3): (3.10, 0.0), ("rmsnorm", 2e-3): (3.12, 0.001),
             ("layernorm_nobias", 4e-3): (3.05, 0.0), ("rmsnorm", 4e-3): (3.10, 0.002)}
    for (norm, lr), (loss, per_seed) in cells.items():
        for seed in range(3 if lr == 4e-3 and "bias" not in norm and norm != "layernorm" else 4):
            make_run(root, f"tiny-{norm}-lr{lr:g}-seed{seed}", norm, seed, loss + per_seed * seed + 0.3 * seed,
                     settings={"optimizer.lr": lr})
    (tuning,) = tune(find_runs([root])[0], "optimizer.lr")
    at = {(c.value, c.bias): c for c in tuning.centring()}
    assert set(at) == {(2e-3, "without"), (4e-3, "with"), (4e-3, "without"), (4e-3, "averaged")}
    without = at[(2e-3, "without")]
    assert without.seeds == (0, 1, 2, 3) and without.by_seed == pytest.approx([0.020, 0.021, 0.022, 0.023])
    assert at[(4e-3, "with")].difference == pytest.approx(0.01) and at[(4e-3, "with")].seeds == (0, 1, 2, 3)
    assert at[(4e-3, "averaged")].seeds == (0, 1, 2)  # the seeds all four arms have there
    assert at[(4e-3, "averaged")].difference == pytest.approx((0.01 + 0.052) / 2)
    (change,) = tuning.centring_changes()
    assert (change.bias, change.lower, change.higher, change.seeds) == ("without", 2e-3, 4e-3, (0, 1, 2))
    half = 4.302653 * 0.001 / math.sqrt(3)
    assert (change.change, change.low, change.high) == pytest.approx((0.031, 0.031 - half, 0.031 + half), abs=1e-6)

    report(f"runs={root}", f"out={tmp_path / 'out'}", "tuning=optimizer.lr")
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "## The centring from one value to the next" in summary
    assert f"| tiny | without | 0.002 | 0.004 | +0.0310 | [{0.031 - half:+.4f}, {0.031 + half:+.4f}] | 3 |" in summary
    (row,) = rows_of(tmp_path / "out" / "tuning_centring_change.csv")
    assert float(row["change"]) == pytest.approx(0.031) and row["seeds"] == "0 1 2"
    centring = {(float(r["value"]), r["bias"]): r for r in rows_of(tmp_path / "out" / "tuning_centring.csv")}
    assert centring[(2e-3, "without")]["n"] == "4" and float(centring[(2e-3, "without")]["low"]) > 0


def test_values_with_different_seeds_are_ranked_on_the_seeds_they_share(tmp_path):
    """The study's rate report: 2e-3 over seeds 0-3 (3.0, 3.0, 3.4, 3.4: mean 3.2), 4e-3 over seeds 0 and 1 only
    (3.1 each). On their own seeds 4e-3 would look 0.1 better; on the seeds both have, 2e-3 is 0.1 better."""
    for seed, loss in enumerate((3.0, 3.0, 3.4, 3.4)):
        make_run(tmp_path / "runs", f"tiny-rmsnorm-lr2e-3-seed{seed}", "rmsnorm", seed, loss,
                 settings={"optimizer.lr": 2e-3})
    for seed in (0, 1):
        make_run(tmp_path / "runs", f"tiny-rmsnorm-lr4e-3-seed{seed}", "rmsnorm", seed, 3.1,
                 settings={"optimizer.lr": 4e-3})
    (tuning,) = tune(find_runs([tmp_path / "runs"])[0], "optimizer.lr")
    low, high = tuning.points
    assert (low.final_val_loss, high.final_val_loss) == pytest.approx((3.2, 3.1))  # each over its own seeds
    assert (low.best, high.best) == (True, False) and high.above_best == pytest.approx(0.1)
    assert low.ranked_seeds == high.ranked_seeds == (0, 1)
    report(f"runs={tmp_path / 'runs'}", f"out={tmp_path / 'out'}", "tuning=optimizer.lr")
    summary = (tmp_path / "out/summary.md").read_text()
    assert "| tiny | rmsnorm | 0.002 | 3.2000 | 0† | 0.2309 | 0 1 2 3 |" in summary  # ranked on fewer seeds: †
    assert "| tiny | rmsnorm | 0.004 | 3.1000 | +0.1000 | 0 | 0 1 |" in summary
    (row,) = [r for r in rows_of(tmp_path / "out/tuning.csv") if r["value"] == "0.002"]
    assert (row["ranked_seeds"], float(row["above_best"])) == ("0 1", 0.0)
