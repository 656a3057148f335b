"""The null of the largest of many sites (probe.extremes) and the seed-level scale of a seed average (probe.profiles),
on planted cases whose answer is known, through real angles CSVs; and the per-direction means that they read, measured
on a tiny model, written and read back."""

import math

import numpy as np
import pytest
import torch

from normlab.common.outputs import check_file, write_csv
from normlab.model.gpt import GPT, GPTConfig
from normlab.model.norms import RMSNorm
from normlab.probe.extremes import Unavailable, extremes, site_extremes
from normlab.probe.hooks import measure
from normlab.probe.profiles import profile
from normlab.probe.sites import norm_sites
from normlab.probe.table import CSV_COLUMNS, PER_DIRECTION_COLUMNS, is_angles_header, read_csv
from normlab.study.angles import append_csv
from normlab.study.report.runs import read_angles
from normlab.training.rundir.tables import read_table

SITES = [(layer, role) for layer in range(4) for role in ("attn_norm", "mlp_norm")] + [(4, "final_norm")]  # tiny: 9
EARLIEST_COLUMNS = CSV_COLUMNS[:-len(PER_DIRECTION_COLUMNS)]  # angles.csv before the per-direction columns
SPREAD = np.linspace(0.005, 0.05, len(SITES))  # the null sd of each site's mean angle, degrees


def null_draw(rng, directions: int) -> np.ndarray:
    """[sites, directions + 1]: mean angles of random directions, independent across directions and sites."""
    return 90 + SPREAD[:, None] * rng.standard_normal((len(SITES), directions + 1))


def write_run(path, targets, null_means, step: int = 150, d: int = 64, columns=CSV_COLUMNS) -> list[dict]:
    """angles.csv of a run (the writer normlab-angles uses) whose input rows hold `targets[s]`, the mean angle to 1
    at site s, and `null_means[s, j]`, to direction j (on the uniform row, as AngleStats.records writes them); read
    back as normlab reads it."""
    rows = []
    for key, target, means in zip(SITES, targets, null_means):
        layer, role = key
        for reference in ("uniform", "random_a"):
            row = {"run": path.stem, "step": step, "layer": layer, "site": f"{role}.input", "reference": reference,
                   "position": "all", "count": 1000, "mean_deg": target if reference == "uniform" else 90.0,
                   "std_deg": 3.0, "sem_deg": 0.1, "min_deg": 80.0, "max_deg": 100.0, "mean_norm": 8.0,
                   "mean_cos2": 1 / d, "null_mean_deg": 90.0, "null_std_deg": math.degrees(d**-0.5),
                   "null_random_mean_deg": means.mean(), "null_random_std_deg": means.std(ddof=1),
                   "null_directions": len(means), "d": d, "histogram": "0 1000"}
            if reference == "uniform" and "null_random_means_deg" in columns:
                row["null_random_means_deg"] = " ".join(f"{m:.5f}" for m in means)
            rows.append(row)
    write_csv(path, columns, rows, "normlab-angles", is_angles_header, extrasaction="ignore")
    return read_csv(path)


def test_a_site_planted_at_5_null_sds_is_named_with_the_smallest_p_max(tmp_path):
    rng = np.random.default_rng(0)
    directions = 999
    draw = null_draw(rng, directions)
    targets, null_means = draw[:, 0], draw[:, 1:]
    targets[4] = 90 + 5 * SPREAD[4]  # layer 2, attention
    result = extremes([write_run(tmp_path / "a.csv", targets, null_means)], ["seed 0"])
    level = result.seed_level
    assert (level.sites, level.directions, result.steps) == (9, directions, {150})
    assert level.site == (2, "attn_norm") and level.z_max == pytest.approx(5, rel=0.1)
    assert level.p_max == 1 / (directions + 1)  # no direction's largest site is as far
    # the largest of 9 independent |z|: P(max < t) = (1 - 2 Phi(-t))^9 = 0.95 at t = 2.77, not 2
    assert 2.55 < level.threshold < 3.0
    assert level.null_sd[(2, "attn_norm")] == pytest.approx(SPREAD[4], rel=0.1)
    assert result.extreme_run[0] == "seed 0" and result.runs[0][1] == level  # one run: its own level


@pytest.mark.parametrize("shared", [0.0, 0.8])
def test_under_the_null_p_max_is_below_5_percent_5_percent_of_the_time_and_some_site_beyond_2_a_third(shared):
    """1's mean angles drawn like the directions': p_max <= 0.05 in 5% of replicates (binomial tolerance, 3.5 sd),
    at any dependence between sites (shared: the correlation of a direction's sites); the naive 'some |z| > 2 of 9
    independent sites' in 1 - 0.9545^9 = 34% of them. p_max <= 0.05 exactly where the largest |z| is above the
    threshold."""
    rng = np.random.default_rng(1)
    replicates, directions = 2000, 199
    below, naive = 0, 0
    for _ in range(replicates):
        common = rng.standard_normal((1, directions + 1))
        draw = 90 + SPREAD[:, None] * (math.sqrt(shared) * common + math.sqrt(1 - shared) * rng.standard_normal(
            (len(SITES), directions + 1)))
        level = site_extremes(SITES, draw[:, 0], draw[:, 1:])
        below += level.p_max <= 0.05
        naive += max(abs(z) for z in level.z.values()) > 2
        assert (level.p_max <= 0.05) == (abs(level.z_max) > level.threshold)
    tolerance = 3.5 * math.sqrt(0.05 * 0.95 / replicates)
    assert abs(below / replicates - 0.05) < tolerance
    if not shared:
        expected = 1 - (1 - 2 * 0.02275) ** len(SITES)
        assert expected == pytest.approx(0.34, abs=0.01)
        assert abs(naive / replicates - expected) < 3.5 * math.sqrt(expected * (1 - expected) / replicates)


def test_the_null_sd_of_a_seed_average_is_that_of_the_averaged_directions(tmp_path):
    """Two runs with independent per-direction means: the seed-level sd is the single-run sd / sqrt 2 (and the
    deviation shown is the statistic's z); two identical runs: the single-run sd; a run without the column: the
    mean of the runs' sds, flagged as the scale of one run."""
    rng = np.random.default_rng(2)
    directions = 1000
    one, two = null_draw(rng, directions), null_draw(rng, directions)
    runs = [write_run(tmp_path / "a.csv", one[:, 0], one[:, 1:]), write_run(tmp_path / "b.csv", two[:, 0], two[:, 1:])]
    points = profile(runs, "input", "uniform")
    level = extremes(runs, ["seed 0", "seed 1"]).seed_level
    for s, key in enumerate(SITES):
        point = points[key]
        assert point.runs == 2 and point.seed_level_null
        assert point.random_sd == pytest.approx(SPREAD[s] / math.sqrt(2), rel=0.08)
        assert point.random_sd == pytest.approx(level.null_sd[key], rel=1e-9)
        assert point.deviation == pytest.approx(level.z[key], rel=1e-9)
        assert profile(runs, "input", "random_a")[key].random_sd == point.random_sd  # from the uniform row
    same = [runs[0], write_run(tmp_path / "a2.csv", one[:, 0], one[:, 1:])]
    for s, point in enumerate(profile(same, "input", "uniform").values()):
        assert point.seed_level_null and point.random_sd == pytest.approx(one[s, 1:].std(ddof=1), abs=1e-6)
    old = write_run(tmp_path / "old.csv", two[:, 0], two[:, 1:], columns=EARLIEST_COLUMNS)
    for s, point in enumerate(profile([runs[0], old], "input", "uniform").values()):
        assert not point.seed_level_null
        assert point.random_sd == pytest.approx((one[s, 1:].std(ddof=1) + two[s, 1:].std(ddof=1)) / 2)


def test_an_outlier_of_one_seed_hidden_by_the_average_is_named_by_its_run(tmp_path):
    rng = np.random.default_rng(3)
    directions = 199
    one, two = null_draw(rng, directions), null_draw(rng, directions)
    one[0, 0], two[0, 0] = 90 - 3 * SPREAD[0], 90 + 5 * SPREAD[0]  # layer 0 attention: seed 1 at +5, seed 0 at -3
    runs = [write_run(tmp_path / "a.csv", one[:, 0], one[:, 1:]), write_run(tmp_path / "b.csv", two[:, 0], two[:, 1:])]
    result = extremes(runs, ["seed 0", "seed 1"])
    assert result.seed_level.p_max > 0.2  # the average: nothing beyond the largest of 9 random sites
    label, run = result.extreme_run
    assert (label, run.site) == ("seed 1", (0, "attn_norm"))
    assert run.z_max == pytest.approx(5, rel=0.1) and run.p_max <= 2 / (directions + 1)
    assert dict(result.runs)["seed 0"].z[(0, "attn_norm")] == pytest.approx(-3, rel=0.1)


def test_without_the_column_or_with_other_directions_the_statistic_says_why(tmp_path):
    rng = np.random.default_rng(4)
    draw = null_draw(rng, 20)
    new = write_run(tmp_path / "new.csv", draw[:, 0], draw[:, 1:])
    old = write_run(tmp_path / "old.csv", draw[:, 0], draw[:, 1:], columns=EARLIEST_COLUMNS)
    assert extremes([new, old], ["seed 0", "seed 1"]) == Unavailable(
        "seed 1 has no null_random_means_deg at 9 of 9 sites (from 0 attn; angles.csv written before the column, or "
        "probe.null_directions=0): measure it again with normlab-angles")
    fewer = write_run(tmp_path / "fewer.csv", draw[:, 0], draw[:, 1:10])
    assert extremes([new, fewer], ["a", "b"]) == Unavailable("the runs have different numbers of random directions "
                                                             "(9, 20)")
    wider = write_run(tmp_path / "wider.csv", draw[:, 0], draw[:, 1:], d=128)
    assert extremes([new, wider], ["a", "b"]) == Unavailable("the runs have different widths d (64, 128): different "
                                                             "directions")
    assert extremes([new], ["a"], step=7) == Unavailable("a has no input angle to uniform at step 7")


def test_a_tiny_model_writes_its_per_direction_means_and_reads_them_back(tmp_path):
    """measure() on a tiny normlab model: the uniform row at position all carries the J mean angles, to 1e-5 degree;
    their mean and sd are null_random_mean_deg and null_random_std_deg; no other row carries them; the report's
    reader gets the same lists; an angles CSV of before the column is still one normlab-angles adds to."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=300), RMSNorm)
    model.init_weights(0)
    ids = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    stats = measure(lambda i, m: model.hidden(i), norm_sites(model, "normlab"), 32, [(ids, None)], null_directions=25)
    write_csv(tmp_path / "angles.csv", CSV_COLUMNS, stats.records(0), "normlab-angles", is_angles_header)
    rows = read_csv(tmp_path / "angles.csv")
    carrying = [r for r in rows if r["null_random_means_deg"] is not None]
    assert {(r["reference"], r["position"], r["site"].split(".")[1]) for r in carrying} == {
        ("uniform", "all", "input"), ("uniform", "all", "output")}
    assert len(carrying) == 2 * 5  # 2 layers x 2 norms + the final norm, input and output
    for r in carrying:
        means = np.array(r["null_random_means_deg"])
        assert len(means) == r["null_directions"] == 25
        assert means.mean() == pytest.approx(r["null_random_mean_deg"], abs=1e-5)
        assert means.std(ddof=1) == pytest.approx(r["null_random_std_deg"], abs=1e-5)
    report_rows = read_angles(tmp_path / "angles.csv", "")
    assert [r["null_random_means_deg"] for r in report_rows] == [r["null_random_means_deg"] for r in rows]
    single = extremes([rows], ["seed 0"]).seed_level
    for key, point in profile([rows], "input", "uniform").items():
        assert single.z[key] == pytest.approx(point.deviation, rel=1e-4, abs=1e-3)  # one run: the row's own null sd
    header = (tmp_path / "angles.csv").read_text().splitlines()[0]
    earlier = header.removesuffix(",null_random_cos2")
    assert is_angles_header(header) and is_angles_header(earlier)
    assert is_angles_header(earlier.removesuffix(",null_random_means_deg"))


def test_normlab_angles_adds_to_an_angles_csv_written_before_the_column(tmp_path):
    """It is accepted as normlab-angles' own output and rewritten with the column, its old rows kept (empty there)."""
    rng = np.random.default_rng(5)
    draw = null_draw(rng, 10)
    out = tmp_path / "pretrained.csv"
    old = write_run(out, draw[:, 0], draw[:, 1:], step=0, columns=EARLIEST_COLUMNS)
    check_file(out, "normlab-angles", is_angles_header)  # raises on a file it did not write
    new = write_run(tmp_path / "new.csv", draw[:, 0], draw[:, 1:], step=10)
    append_csv(out, read_table(tmp_path / "new.csv")[1])  # its rows as text, as records() gives them
    rows = read_csv(out)
    assert out.read_text().splitlines()[0] == ",".join(CSV_COLUMNS)
    assert [r["null_random_means_deg"] for r in rows if r["step"] == 0] == [None] * len(old)
    assert [r["null_random_means_deg"] for r in rows if r["step"] == 10] == [r["null_random_means_deg"] for r in new]
