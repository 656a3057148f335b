"""The verdict recomputed from the files a study commits, with csv and numpy alone (no normlab): each norm's angle
statistics from angles_by_site.csv (every random direction's mean angle and mean cos² per run and site), its
ablation and the ablation's null from ablations.csv, each comparison's numbers from its seeds' differences and its
sign along training from loss_by_validation.csv; planted so that the seeds' 1-components point opposite ways at one
site (the signed statistic cancels there, the sign-invariant one does not) and the seeds' losses cross during
training."""

import csv
import math

import numpy as np
import pytest

from test_report import OLD_COLUMNS, D, angle_rows, make_run, report, write_ablation, write_csv

DIRECTIONS, SEEDS = 39, 3
T_975_2DF = 4.302652729749464  # Student's t, 97.5% quantile, 2 degrees of freedom
# seed -> the final validation losses (steps 2, 4, 6, 8, 10) of LN and RMS: RMS above LN early, below it late
LOSSES = {0: ([4.0, 3.6, 3.3, 3.1, 3.00], [3.9, 3.65, 3.31, 3.08, 2.98]),
          1: ([4.1, 3.7, 3.4, 3.2, 3.10], [4.2, 3.72, 3.38, 3.19, 3.07]),
          2: ([4.0, 3.5, 3.3, 3.1, 3.05], [4.1, 3.51, 3.32, 3.09, 3.04])}


def planted_angles(run, seed: int) -> None:
    """angles.csv at step 10: at layer 1's MLP norm input, 1 at 88.5°, 91.5° and 90° in seeds 0, 1 and 2 (their
    average 90°) and a share along 1 four times a random direction's; elsewhere 90° and 1/d; every random
    direction's values drawn."""
    rng = np.random.default_rng(100 + seed)
    rows = angle_rows(10, 90.0, 1 / D, null_random_sd=0.2)
    for row in rows:
        if row["reference"] == "uniform" and row["site"].endswith(".input"):
            planted = row["layer"] == 1 and row["site"] == "mlp_norm.input"
            row["mean_deg"] = (88.5, 91.5, 90.0)[seed] if planted else 90.0 + rng.normal(0, 0.1)
            row["mean_cos2"] = 4 / D if planted else rng.gamma(8, 1 / (8 * D))
            row["null_random_means_deg"] = " ".join(f"{v:.6f}" for v in rng.normal(90, 0.4, DIRECTIONS))
            row["null_random_cos2"] = " ".join(f"{v:.8f}" for v in rng.gamma(8, 1 / (8 * D), DIRECTIONS))
    write_csv(run / "angles.csv", rows, [*OLD_COLUMNS, "null_random_mean_deg", "null_random_std_deg",
                                         "null_random_means_deg", "null_random_cos2"])


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit")
    for seed, (ln, rms) in LOSSES.items():
        for norm, losses in (("layernorm", ln), ("rmsnorm", rms)):
            run = make_run(root / "exp", f"tiny-{norm}-seed{seed}", norm, seed, losses[-1],
                           settings={"analysis.final_validations": 1})
            write_csv(run / "metrics.csv", [{"step": 2 * k + 1, "val/loss": v} for k, v in enumerate(losses)],
                      ["step", "val/loss"])
            planted_angles(run, seed)
        write_ablation(root / "exp" / f"tiny-rmsnorm-seed{seed}", 0.02 + 0.005 * seed, 0.01, 0.03,
                       null=[0.001 * k for k in range(10)] + [0.026 + 0.001 * seed])
    report(f"runs={root / 'exp'}", f"out={root / 'out'}", "learning_check=false")
    return root / "out"


def read(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def values(text: str) -> np.ndarray:
    return np.array([float(v) for v in text.split()])


def verdict_row(out, norm: str) -> dict:
    (row,) = [r for r in read(out / "verdict_norms.csv") if r["norm"] == norm]
    return row


def site_arrays(out, norm: str):
    """[runs, sites] of 1's mean angle and mean cos²; [runs, sites, directions] of the random directions'."""
    rows = [r for r in read(out / "angles_by_site.csv") if r["norm"] == norm and r["site"].endswith(".input")]
    runs = sorted({r["run"] for r in rows})
    sites = sorted({(int(r["layer"]), r["site"]) for r in rows})
    by = {(r["run"], int(r["layer"]), r["site"]): r for r in rows}
    table = [[by[(run, *site)] for site in sites] for run in runs]
    take = lambda key: np.array([[float(r[key]) for r in row] for row in table])  # noqa: E731
    per_direction = lambda key: np.array([[values(r[key]) for r in row] for row in table])  # noqa: E731
    return (take("mean_deg"), per_direction("null_random_means_deg"), take("mean_cos2"),
            per_direction("null_random_cos2"))


def leave_one_out_sd(x: np.ndarray) -> np.ndarray:
    """The sd over the last axis without entry j, for each j, by brute force."""
    return np.stack([np.delete(x, j, axis=-1).std(axis=-1, ddof=1) for j in range(x.shape[-1])], axis=-1)


def largest_p(largest: float, null_largest: np.ndarray) -> float:
    return (1 + (null_largest >= largest).sum()) / (1 + len(null_largest))


def test_the_signed_angle_statistic_is_recomputed_and_cancels_where_the_seeds_disagree(reported):
    angles, null_angles, _, _ = site_arrays(reported, "rmsnorm")
    mean, null_mean = angles.mean(axis=0), null_angles.mean(axis=0)  # the seeds' average: [sites], [sites, J]
    z = (mean - 90) / null_mean.std(axis=1, ddof=1)
    null_z = np.abs((null_mean - 90) / leave_one_out_sd(null_mean)).max(axis=0)
    row = verdict_row(reported, "rmsnorm")
    assert float(row["angle_z"]) == pytest.approx(z[np.abs(z).argmax()], rel=1e-6)
    assert float(row["angle_p"]) == pytest.approx(largest_p(np.abs(z).max(), null_z))
    assert int(row["sites"]) == len(z) == 5
    assert row["angle_site"] != "1 MLP" and float(row["angle_p"]) > 0.05  # the planted site's angles cancel


def test_the_sign_invariant_statistic_share_and_percentile_are_recomputed_and_find_the_planted_site(reported):
    _, _, cos2, null_cos2 = site_arrays(reported, "rmsnorm")
    own = (cos2 - null_cos2.mean(axis=2)) / null_cos2.std(axis=2, ddof=1)  # each seed against its own directions
    z = own.sum(axis=0) / math.sqrt(SEEDS)
    others = (DIRECTIONS * null_cos2.mean(axis=2, keepdims=True) - null_cos2) / (DIRECTIONS - 1)
    null_z = np.abs(((null_cos2 - others) / leave_one_out_sd(null_cos2)).sum(axis=0) / math.sqrt(SEEDS)).max(axis=0)
    row = verdict_row(reported, "rmsnorm")
    assert float(row["cos2_z"]) == pytest.approx(z[np.abs(z).argmax()], rel=1e-6)
    assert float(row["cos2_p"]) == pytest.approx(largest_p(np.abs(z).max(), null_z)) == 1 / (DIRECTIONS + 1)
    assert row["cos2_site"] == "1 MLP"  # the planted site, whose signed angles cancel over the seeds
    share, null_share = cos2.mean(axis=0), null_cos2.mean(axis=0)
    site = share.argmax()
    assert float(row["share"]) == pytest.approx(share[site], rel=1e-6) == pytest.approx(4 / D, rel=1e-6)
    below = (null_share[site] < share[site]).sum() + 0.5 * (null_share[site] == share[site]).sum()
    assert float(row["share_percentile"]) == pytest.approx(100 * below / DIRECTIONS) == 100.0


def test_the_ablation_and_its_null_are_recomputed_from_ablations_csv(reported):
    rows = [r for r in read(reported / "ablations.csv") if r["norm"] == "rmsnorm" and r["site"] == "all"]
    along_1 = np.array([float(r["delta"]) for r in rows if r["direction"] == "1"])
    by_direction = {}
    for r in rows:
        if r["direction"] != "1":
            by_direction.setdefault(r["direction"], []).append(float(r["delta"]))
    null = np.array([np.mean(v) for v in by_direction.values()])
    row = verdict_row(reported, "rmsnorm")
    half = T_975_2DF * along_1.std(ddof=1) / math.sqrt(len(along_1))
    assert [float(row[k]) for k in ("ablation_delta", "ablation_low", "ablation_high")] == pytest.approx(
        [along_1.mean(), along_1.mean() - half, along_1.mean() + half], rel=1e-9)
    below = (null < along_1.mean()).sum() + 0.5 * (null == along_1.mean()).sum()
    assert float(row["ablation_null_pct"]) == pytest.approx(100 * below / len(null)) == pytest.approx(100 * 10 / 11)


def test_the_comparison_and_its_sign_along_training_are_recomputed_from_the_seeds_and_the_validations(reported):
    (row,) = read(reported / "verdict_comparisons.csv")
    per_seed = values(row["per_seed"])
    assert per_seed == pytest.approx([rms[-1] - ln[-1] for ln, rms in LOSSES.values()])
    half = T_975_2DF * per_seed.std(ddof=1) / math.sqrt(SEEDS)
    mean = per_seed.mean()
    assert [float(row[k]) for k in ("mean", "ci_low", "ci_high", "sim_low", "sim_high")] == pytest.approx(
        [mean, mean - half, mean + half, mean - half, mean + half], rel=1e-9)  # a family of one: its own interval
    assert int(row["above_0"]) == (per_seed > 0).sum() == 0
    validations = read(reported / "loss_by_validation.csv")
    steps = [int(r["step"]) for r in validations]
    means = [values(r["per_seed"]).mean() for r in validations]
    assert steps == [2, 4, 6, 8, 10] and means == pytest.approx([float(r["mean"]) for r in validations])
    second = [(s, m) for s, m in zip(steps, means) if s > 10 / 2]  # the second half: steps 6, 8, 10
    changes = [s for (_, a), (s, b) in zip(second, second[1:]) if (a > 0) != (b > 0)]
    assert changes == [8]  # RMS above LN at step 6, below from step 8 on
    assert row["second_half"].startswith("mean over seeds, steps 6-10: changed sign at step 8; ")
