"""normlab-report on synthetic run directories: real configs (composed from conf/), metrics.csv and angles.csv written
here with known values, so that the pairing, the confidence interval and the verdict are checked against numbers
computed by hand. No training: each test takes seconds."""

import copy
import csv
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from conftest import compose_config, written_before
from normlab.interop.evaluate import CSV_COLUMNS
from normlab.probe.table import REFERENCES, AnalysisError
from normlab.study.report import main
from normlab.study.report.groups import Declared, group_runs
from normlab.study.report.intervals import Interval, t_quantile_975
from normlab.study.report.runs import find_runs
from test_angle_shares import PLANTED, measured_table, seed_inputs

N_LAYER, D, COUNT = 2, 64, 10_000
OLD_COLUMNS = ["step", "layer", "site", "reference", "position", "count", "mean_deg", "std_deg", "min_deg",
               "max_deg", "mean_norm", "mean_cos2", "null_mean_deg", "null_std_deg", "d", "histogram"]  # angles.csv
NEW_COLUMNS = ["run", "model", "norm", "seed", "source", *OLD_COLUMNS, "sem_deg", "null_percentile",  # and with the
               "null_random_mean_deg", "null_random_std_deg", "null_directions"]  # null over random directions
SINGLE_NULL_SD = math.degrees(1 / math.sqrt(D))  # 7.16 degrees
ABLATION_COLUMNS = ["run", "model", "norm", "seed", "step", "source", "site", "layer", "role", "ablation", "windows",
                    "tokens", "loss", "ablated_loss", "delta", "ci_low", "ci_high", "share_along_1", "d"]
COMPOSED = {}


def composed(norm: str):
    """The train config of `norm` (the tiny model with 2 layers), composed once per norm."""
    if norm not in COMPOSED:
        COMPOSED[norm] = compose_config("train", [f"norm={norm}", f"model.n_layer={N_LAYER}"])
    return copy.deepcopy(COMPOSED[norm])


def write_csv(path: Path, rows: list[dict], columns) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def angle_rows(step: int, final_angle: float, final_share: float, null_random_sd: float | None = None,
               **columns) -> list[dict]:
    """Every norm site at `step`: 90 degrees to every reference, but the final norm's input, which makes
    `final_angle` with 1 (and holds `final_share` of its squared norm along it)."""
    sites = [(layer, f"{role}.{io}") for layer in range(N_LAYER) for role in ("attn_norm", "mlp_norm")
             for io in ("input", "output")] + [(N_LAYER, "final_norm.input"), (N_LAYER, "final_norm.output")]
    rows = []
    for layer, site in sites:
        for reference in REFERENCES:
            special = site == "final_norm.input" and reference == "uniform"
            row = {"step": step, "layer": layer, "site": site, "reference": reference, "position": "all",
                   "count": COUNT, "mean_deg": final_angle if special else 90.0, "std_deg": 5.0, "min_deg": 70.0,
                   "max_deg": 110.0, "mean_norm": 1.0, "mean_cos2": final_share if special else 1 / D,
                   "null_mean_deg": 90.0, "null_std_deg": SINGLE_NULL_SD, "d": D, "histogram": "0 1 0", **columns}
            if null_random_sd is not None:
                row |= {"null_random_mean_deg": 90.0, "null_random_std_deg": null_random_sd}
            rows.append(row)
    return rows


def make_run(root: Path, name: str, norm: str = "layernorm", seed: int = 0, loss: float = 3.0, steps: int = 10,
             max_steps: int = 10, final_angle: float = 90.0, experiment: str = "exp", settings: dict | None = None,
             norm_keys: dict | None = None, norm_config: dict | None = None) -> Path:
    """A run directory as normlab-train leaves it after `steps` of `max_steps` optimizer steps: config.yaml (its
    `norm` replaced by `norm_config` where given, with `norm_keys` set, or removed where None), metrics.csv (final
    validation loss `loss`) and angles.csv (steps 0 and `steps`, in the format before the null over random
    directions)."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    cfg = composed(norm)
    cfg.seed, cfg.run_dir, cfg.experiment_name, cfg.trainer.max_steps = seed, str(run_dir), experiment, max_steps
    OmegaConf.set_struct(cfg, False)
    if norm_config is not None:
        cfg.norm = norm_config
    for key, value in {**(settings or {}), **{f"norm.{k}": v for k, v in (norm_keys or {}).items()}}.items():
        if value is None:
            cfg.norm.pop(key.removeprefix("norm."))
        else:
            OmegaConf.update(cfg, key, value, force_add=True)
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    metrics = [{"step": s, "train/loss": loss + 1 + 1 / (s + 1), "train/tokens_per_sec": 1000.0} for s in range(steps)]
    metrics += [{"step": steps // 2 - 1, "val/loss": loss + 0.5}, {"step": steps - 1, "val/loss": loss}]  # logged at
    write_csv(run_dir / "metrics.csv", metrics, ["step", "train/loss", "train/tokens_per_sec", "val/loss"])  # step-1
    write_csv(run_dir / "angles.csv", angle_rows(0, 90.0, 1 / D) + angle_rows(steps, final_angle, 0.05), OLD_COLUMNS)
    return run_dir


def user_norm_run(root: Path, name: str, seed: int = 0, loss: float = 3.0, norm: str = "scalenorm", **layer) -> Path:
    """A run of a user's ScaleNorm (tests/user_norms.py) as the user's conf/norm/<norm>.yaml gives it: a name and a
    layer, no style."""
    layer = {"_target_": "user_norms.ScaleNorm", "_partial_": True, "eps": 1e-5, **layer}
    return make_run(root, name, "rmsnorm", seed, loss, norm_config={"name": norm, "layer": layer})


def write_ablation(run_dir: Path, delta: float, low: float, high: float, site_delta: float | None = None,
                   step: int = 10, **columns) -> None:
    """ablation.csv as normlab-ablate writes it for an RMS run: its inputs centred at one norm (`site_delta`, default
    delta / 2), and at all."""
    site = delta / 2 if site_delta is None else site_delta
    rows = [{"site": "layer00.attn_norm", "layer": 0, "role": "attn_norm", "delta": site, "ci_low": site - 0.001,
             "ci_high": site + 0.001},
            {"site": "all", "layer": "", "role": "", "delta": delta, "ci_low": low, "ci_high": high}]
    write_csv(run_dir / "ablation.csv", [{"step": step, "ablation": "centred", **r, **columns} for r in rows],
              ABLATION_COLUMNS + list(columns))


def report(*args: str, figures: bool = False) -> None:
    """normlab-report with `args`; its figures only where a test reads them (drawing them is most of its time)."""
    main(compose_config("report", [*args, f"figures={str(figures).lower()}"]))


def png_width(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[16:20], "big")  # the IHDR chunk


def test_t_quantiles_match_the_exact_values():
    for df, exact in ((1, 12.7062047), (2, 4.3026527), (30, 2.0422725)):  # printed tables, to 7 decimals
        assert t_quantile_975(df) == pytest.approx(exact, abs=1e-7)
    assert t_quantile_975(40) == pytest.approx(2.021075, abs=1e-6)  # scipy.stats.t.ppf(0.975, 40)
    assert t_quantile_975(120) == pytest.approx(1.979930, abs=1e-6)


def test_interval_of_paired_differences_by_hand():
    interval = Interval.of([0.02, 0.03, 0.01])  # mean 0.02, sd 0.01, t(2) = 4.3027
    half = 4.3026527 * 0.01 / math.sqrt(3)
    assert (interval.mean, interval.sd) == (pytest.approx(0.02), pytest.approx(0.01))
    assert (interval.low, interval.high) == (pytest.approx(0.02 - half), pytest.approx(0.02 + half))
    assert interval.excludes_zero is False
    assert Interval.of([0.02, 0.021, 0.019]).excludes_zero is True
    single = Interval.of([0.05])
    assert single.low is None and single.excludes_zero is None and single.text() == "+0.0500 (1 pair: no interval)"


def test_report_pairs_by_seed_flags_unfinished_runs_and_skips_replaced_ones(tmp_path):
    sweep = tmp_path / "exp"
    for seed, (ln, rms) in enumerate([(3.00, 3.02), (3.10, 3.13), (3.05, 3.06)]):
        make_run(sweep, f"tiny-layernorm-seed{seed}", "layernorm", seed, ln, final_angle=90.1)
        make_run(sweep, f"tiny-rmsnorm-seed{seed}", "rmsnorm", seed, rms, final_angle=91.0)
    make_run(sweep, "tiny-layernorm-seed3", "layernorm", 3, 3.0)
    make_run(sweep, "tiny-rmsnorm-seed3", "rmsnorm", 3, 2.0, steps=6)  # unfinished: its better loss must not count
    make_run(sweep, "tiny-rmsnorm-seed1.replaced-20250101-000000", "rmsnorm", 1, 9.9)  # moved aside by restart=true
    write_ablation(sweep / "tiny-rmsnorm-seed0", 0.0123, 0.0100, 0.0146)

    report(f"runs={sweep}", f"out={tmp_path / 'out'}", figures=True)

    summary = (tmp_path / "out/summary.md").read_text()
    # differences 0.02, 0.03, 0.01: mean 0.02 +- 4.3027 x 0.01 / sqrt(3) = 0.0248; t = 3.464 on 2 df: p 0.0742, alone
    # in its family (Holm changes nothing); 3 of 3 above 0: sign test 0.25; (4.3027 + t_0.8 1.0607) x 0.00577 = 0.0310
    assert ("| tiny† | rmsnorm | 3 | 10 | rmsnorm − layernorm (the bias differs too): +0.0200 [-0.0048, +0.0448] "
            "(t over 3 seeds, 2 df), Holm [-0.0048, +0.0448], p 0.0742: includes 0; above 0 in 3 of 3 seeds (sign "
            "test p 0.25); 80% power at ±0.0310 |") in summary
    assert ("| rmsnorm − layernorm (the bias differs too) | paired t | 3 (0, 1, 2) | +0.0200, +0.0300, +0.0100 | "
            "+0.0200 | [-0.0048, +0.0448] (2 df) | Holm [-0.0048, +0.0448], p 0.0742 | no | 3 of 3 (0.25) | ±0.0310 |"
            ) in summary
    assert "| tiny-rmsnorm-seed3 | rmsnorm | 3 |" in summary and "| 6 of 10 |" in summary
    assert "**unfinished: step 6 of 10: left out**" in summary
    assert "tiny-layernorm-seed3 | layernorm | 3 |" in summary and "no run of the other norm with its seed" in summary
    assert "tiny-rmsnorm-seed1.replaced-20250101-000000" in summary.split("## tiny")[0]  # listed as skipped
    assert "9.9" not in summary
    # the final norm's input at 91 degrees: 1 / (7.16 / sqrt(10000)) = +14.0 null sds of independent tokens (‡)
    assert ("| +14.0 (final, 91.00°)‡§, largest of 5 sites; sign-invariant: unavailable¶ | 0.0500 (final; 1/d = "
            "0.0156; no percentile¶) | centred: +0.0123 [+0.0100, +0.0146] (bootstrap over windows); 2 runs not "
            "ablated |") in summary
    assert "¶ no sign-invariant statistic nor share percentile" in summary and "has no null_random_cos2" in summary
    assert f"not run (normlab-ablate model_path={sweep / 'tiny-layernorm-seed0'})" in summary
    assert "‡ null sd of a mean over independent tokens" in summary and "† demo scale: not evidence" in summary
    assert "§ the largest of the sites in null sds with no null of the largest" in summary
    assert "has no null_random_means_deg at 5 of 5 sites" in summary
    # no sentence claims more than its statistic: an interval is not seed agreement, a failure to reject is no proof
    # and an inference-time ablation says nothing about training
    text = " ".join(summary.split())  # the sentences, whatever their line breaks
    for overclaim in ("seeds agree on which norm", "the centring does no work", "no more special than a random"):
        assert overclaim not in text
    assert "not that every seed agrees" in text and "not that the norms are equal" in text
    assert "does not say whether centring helped training" in text
    for figure in ("loss", "loss_difference", "angles_by_layer", "references", "angles_training", "ablation"):
        assert (tmp_path / f"out/{figure}_tiny.pdf").read_bytes()[:5] == b"%PDF-"
        assert f"({figure}_tiny.png)" in summary
    assert png_width(tmp_path / "out/loss_tiny.png") == 7.2 * 300  # print resolution


def test_figures_false_writes_the_tables_and_numbers_and_no_figure(tmp_path, capsys):
    for seed in (0, 1):
        make_run(tmp_path / "sweep", f"ln-seed{seed}", "layernorm", seed, 3.0)
        make_run(tmp_path / "sweep", f"rms-seed{seed}", "rmsnorm", seed, 3.01 + seed / 100)

    report(f"runs={tmp_path / 'sweep'}", f"out={tmp_path / 'out'}")  # figures=false

    out = tmp_path / "out"
    assert "rmsnorm − layernorm" in (out / "summary.md").read_text() and (out / "comparisons.csv").is_file()
    assert not list(out.glob("*.png")) and not list(out.glob("*.pdf")) and "![" not in (out / "summary.md").read_text()
    assert "wrote summary.md, no figures (figures=false) and its numbers" in capsys.readouterr().out
    with pytest.raises(AnalysisError, match=r"^figures=maybe: give true or false$"):
        main(compose_config("report", [f"runs={tmp_path / 'sweep'}", "figures=maybe", f"out={tmp_path / 'x'}"]))
    assert not (tmp_path / "x").exists()


def test_the_ablation_of_several_seeds_gives_a_t_interval_over_seeds_each_seed_and_its_sign_changes(tmp_path):
    for seed in (0, 1):
        make_run(tmp_path / "sweep", f"ln-seed{seed}", "layernorm", seed, 3.0)
        make_run(tmp_path / "sweep", f"rms-seed{seed}", "rmsnorm", seed, 3.01)
    write_ablation(tmp_path / "sweep/rms-seed0", 0.01, 0.008, 0.012, site_delta=0.004)
    write_ablation(tmp_path / "sweep/rms-seed1", 0.03, 0.025, 0.035, site_delta=-0.002, step=8,
                   resampling_unit="blocks of 4096 tokens")

    report(f"runs={tmp_path / 'sweep'}", f"out={tmp_path / 'out'}")

    summary = (tmp_path / "out/summary.md").read_text()
    # 0.01 and 0.03: mean 0.02, sd 0.01414, half-width 12.7062 x 0.01414 / sqrt 2 = 0.1271; seed 1 ablated at step 8
    assert ("| centred: +0.0200 [-0.1071, +0.1471] (t over 2 seeds) (step 8, 10); per seed: seed 0 +0.0100 "
            "[+0.0080, +0.0120] (bootstrap over windows), seed 1 +0.0300 [+0.0250, +0.0350] (bootstrap over blocks of "
            "4096 tokens); sign changes between seeds at 1 of 1 sites (layer00.attn_norm) |") in summary
    assert "mean of 2 seeds" not in summary  # the range of two seeds is no interval


def angles_with_direction_means(run_dir: Path, planted: dict[str, float], seed: int, directions: int = 39,
                                sd: float = 0.2, step: int = 10) -> None:
    """angles.csv at step 10 whose rows carry each random direction's mean angle (drawn about 90 with `sd`), with
    the mean angle to 1 at 90 but at the norm inputs named in `planted` (site -> angle)."""
    generator = np.random.default_rng(seed)
    rows = angle_rows(step, 90.0, 1 / D, null_random_sd=sd)
    for row in rows:
        if row["reference"] == "uniform" and row["site"].endswith((".input", ".output")):
            row["null_random_means_deg"] = " ".join(f"{v:.5f}" for v in generator.normal(90, sd, directions))
            row["mean_deg"] = planted.get(f"{row['layer']}.{row['site']}", 90.0)
    write_csv(run_dir / "angles.csv", rows, [*OLD_COLUMNS, "null_random_mean_deg", "null_random_std_deg",
                                             "null_random_means_deg"])


def test_the_angle_cell_weighs_the_largest_site_against_the_largest_of_random_directions_and_names_the_seed(
        tmp_path):
    planted = [{"2.final_norm.input": 91.0, "0.attn_norm.input": 88.8},  # seed 0
               {"2.final_norm.input": 91.0, "0.attn_norm.input": 91.6}]  # seed 1: its outlier hidden by the mean
    for seed in (0, 1):
        make_run(tmp_path / "sweep", f"ln-seed{seed}", "layernorm", seed, 3.0)
        run = make_run(tmp_path / "sweep", f"rms-seed{seed}", "rmsnorm", seed, 3.01)
        angles_with_direction_means(run, planted[seed], seed)

    report(f"runs={tmp_path / 'sweep'}", f"out={tmp_path / 'out'}")

    summary = (tmp_path / "out/summary.md").read_text()
    (row,) = [line for line in summary.splitlines() if line.startswith("| tiny† | rmsnorm |")]
    # the final norm's input 1 degree off 90 in both seeds: about 7 sds of the average of two runs' direction means
    # (0.2 / sqrt 2), beyond every one of the 39 directions' largest site: p = 1 / 40
    # seed 1, picked as the more extreme of 2 runs: 1 - (1 - 0.025)^2 = 0.049
    found = re.search(r"\| signed: \+(\d+\.\d) at final \(91\.00°\), largest of 5 sites: p 0\.025 \(5% threshold "
                      r"(\d\.\d); 39 directions\); most extreme run: seed 1, \+(\d+\.\d) at 0 attn \(p 0\.025 for "
                      r"one run; 0\.049 for the most extreme of 2, Šidák\); sign-invariant: unavailable¶ \|", row)
    assert found, row
    z, threshold, seed_z = map(float, found.groups())
    assert 5 < z < 10 and 2 < threshold < 4 and 6 < seed_z < 11  # 1.6 / 0.2 = 8 for seed 1 alone
    assert "(step" not in row  # the angles are of the loss's step
    assert "§" not in row  # (the LayerNorm runs' angles.csv, without the direction means, have the § footnote)


def test_the_angle_cell_finds_opposite_signs_by_their_cos2_and_the_share_cell_places_the_share_among_directions(
        tmp_path):
    """The RMS runs' angles.csv measured by the real probe on constructed inputs (test_angle_shares), a component
    0.15 * 1 at 1 attn of sign + in seed 0 and - in seed 1: the signed average cancels, the sign-invariant statistic
    finds it beyond every one of the 99 directions; the most extreme run's p is corrected for the 2 it was picked
    from; the share gets its percentile among the directions' shares."""
    for seed in (0, 1):
        make_run(tmp_path / "sweep", f"ln-seed{seed}", "layernorm", seed, 3.0)
        run = make_run(tmp_path / "sweep", f"rms-seed{seed}", "rmsnorm", seed, 3.01)
        (run / "angles.csv").unlink()  # make_run's, of before the null over random directions
        measured_table(run / "angles.csv", seed_inputs(seed, {PLANTED: 0.15 * (-1) ** seed}))

    report(f"runs={tmp_path / 'sweep'}", f"out={tmp_path / 'out'}")

    summary = (tmp_path / "out/summary.md").read_text()
    (row,) = [line for line in summary.splitlines() if line.startswith("| tiny† | rmsnorm |")]
    angle, share = row.split(" | ")[5:7]
    signed = re.match(r"signed: [+-]\d+\.\d at [^:]+: p (\d\.\d{3}) \(5% threshold \d\.\d; 99 directions\); most "
                      r"extreme run: seed [01], [+-]\d+\.\d at 1 attn \(p 0\.010 for one run; 0\.020 for the most "
                      r"extreme of 2, Šidák\); sign-invariant, mean cos² along 1 \(Stouffer over 2 runs\): "
                      r"\+(\d+\.\d) at 1 attn, largest of 5 sites: p 0\.010 \(5% threshold \d\.\d\)$", angle)
    assert signed, angle
    assert float(signed[1]) > 0.05 and float(signed[2]) > 3  # the signed average cancels; cos² does not
    assert re.fullmatch(r"0\.\d{4} \(1 attn\): percentile 100\.0 of 99 random directions' shares there \(their "
                        r"median 0\.\d{4}; 1/d = 0\.0312\)", share), share
    assert "¶" not in row and "¶ no sign-invariant statistic" in summary  # the LayerNorm runs' files lack it


def test_angles_of_another_step_than_the_loss_say_so(tmp_path):
    make_run(tmp_path / "sweep", "ln-seed0", "layernorm", 0, 3.0)
    angles_with_direction_means(make_run(tmp_path / "sweep", "rms-seed0", "rmsnorm", 0, 3.01), {}, 0, step=8)

    report(f"runs={tmp_path / 'sweep'}", f"out={tmp_path / 'out'}")

    (row,) = [line for line in (tmp_path / "out/summary.md").read_text().splitlines()
              if line.startswith("| tiny† | rmsnorm |")]
    assert "| 10 |" in row and "39 directions) (step 8);" in row  # the loss of step 10, the angles of step 8


def test_runs_are_grouped_by_their_settings_never_by_their_names(tmp_path):
    for experiment, settings in [("a", {}), ("b", {"trainer.max_steps": 20}), ("c", {"optimizer.lr": 0.001}),
                                 ("d", {})]:
        for norm in ("layernorm", "rmsnorm"):
            max_steps = settings.get("trainer.max_steps", 10)
            make_run(tmp_path / experiment, f"tiny-{norm}-seed0", norm, steps=max_steps, max_steps=max_steps,
                     experiment=experiment, settings={k: v for k, v in settings.items() if k != "trainer.max_steps"})

    runs, replaced = find_runs([tmp_path])
    groups = group_runs(runs)

    assert replaced == [] and len(runs) == 8
    by_names = {tuple(sorted(r.name for r in g.runs)): g for g in groups}
    assert set(by_names) == {
        ("a/tiny-layernorm-seed0", "a/tiny-rmsnorm-seed0", "d/tiny-layernorm-seed0", "d/tiny-rmsnorm-seed0"),
        ("b/tiny-layernorm-seed0", "b/tiny-rmsnorm-seed0"),
        ("c/tiny-layernorm-seed0", "c/tiny-rmsnorm-seed0"),
    }
    assert len({g.slug for g in groups}) == 3 and all(g.slug.startswith("tiny-") for g in groups)
    same = by_names[("a/tiny-layernorm-seed0", "a/tiny-rmsnorm-seed0", "d/tiny-layernorm-seed0",
                     "d/tiny-rmsnorm-seed0")]
    assert sorted(r.name for r in same.runs if "a replicate" in r.left_out) == ["d/tiny-layernorm-seed0",
                                                                               "d/tiny-rmsnorm-seed0"]
    assert [len(c.pairs) for c in same.comparisons] == [1]
    assert "trainer.max_steps=20" in by_names[("b/tiny-layernorm-seed0", "b/tiny-rmsnorm-seed0")].distinct
    assert "optimizer.lr=0.001" in by_names[("c/tiny-layernorm-seed0", "c/tiny-rmsnorm-seed0")].distinct


def test_a_2x2_sweep_of_centring_and_bias_gives_two_comparisons_and_its_table(tmp_path):
    losses = {"layernorm": (3.000, 3.100), "rmsnorm_bias": (3.030, 3.120), "layernorm_nobias": (3.020, 3.110),
              "rmsnorm": (3.010, 3.115)}  # per seed
    for norm, per_seed in losses.items():
        for seed, loss in enumerate(per_seed):
            make_run(tmp_path / "sweep", f"{norm}-seed{seed}", norm, seed, loss)

    (group,) = group_runs(find_runs([tmp_path / "sweep"])[0])
    report(f"runs={tmp_path / 'sweep'}", f"out={tmp_path / 'out'}")

    assert [(c.label, len(c.pairs)) for c in group.comparisons] == [
        ("rmsnorm_bias − layernorm (with bias)", 2), ("rmsnorm − layernorm_nobias (without bias)", 2)]
    summary = (tmp_path / "out/summary.md").read_text()
    # by hand, the factorial blocked by seed: seed 0 − seed 1 per cell -0.100, -0.090, -0.090, -0.105 (mean
    # -0.09625); residuals ±(d - mean) / 2: SS = 2 x 4.21875e-5, on 3 df: sd 0.0053033. The centring with a bias:
    # 0.025 ± 3.1824 x 0.0053033 (weights ±1: se = sd) = [+0.0081, +0.0419]; without: -0.0025 [-0.0194, +0.0144];
    # averaged over bias 0.01125 ± 3.1824 x 0.00375; interaction 0.0275 ± 3.1824 x 0.0075. Holm over the 5: the
    # centring's is third by p (0.0577 x 3 = 0.173)
    assert "### Centring × bias, paired by seed" in summary
    assert "| with | layernorm: 3.0500 | rmsnorm_bias: 3.0750 |" in summary
    assert "| without | layernorm_nobias: 3.0650 | rmsnorm: 3.0625 |" in summary
    assert ("| **primary**: centring, averaged over bias (uncentred − centred) | +0.0112 [-0.0007, +0.0232] "
            "(t over 2 seeds, 3 df) | Holm [-0.0070, +0.0295], p 0.173 |") in summary
    assert "| interaction (the centring's effect with a bias − without) | +0.0275 [+0.0036, +0.0514]" in summary
    assert ("| rmsnorm_bias − layernorm (with bias) | 2x2 factorial blocked by seed, pooled residual | 2 (0, 1) | "
            "+0.0300, +0.0200 | +0.0250 | [+0.0081, +0.0419] (3 df) |") in summary
    assert "| +0.0250 | [+0.0081, +0.0419] (3 df) |" in summary and "| -0.0025 | [-0.0194, +0.0144] (3 df) |" in summary
    assert "differ in the bias as well as in the centring" not in summary  # each comparison is the centring's alone


def test_a_2x2_cell_pair_without_a_common_seed_says_so(tmp_path):
    for norm, seed in (("layernorm", 0), ("rmsnorm_bias", 1), ("layernorm_nobias", 0), ("rmsnorm", 0)):
        make_run(tmp_path / "sweep", f"{norm}-seed{seed}", norm, seed, 3.0)

    report(f"runs={tmp_path / 'sweep'}", f"out={tmp_path / 'out'}")

    summary = (tmp_path / "out/summary.md").read_text()
    assert "### Centring × bias" not in summary  # no seed has all four cells: no factorial
    assert "Primary contrast of tiny (analysis.primary=centring): not estimable here" in summary


def test_the_paper_pair_says_that_the_bias_differs_too_and_has_no_2x2_table(tmp_path):
    for seed in (0, 1):
        make_run(tmp_path / "sweep", f"ln-seed{seed}", "layernorm", seed, 3.0)
        make_run(tmp_path / "sweep", f"rms-seed{seed}", "rmsnorm", seed, 3.01 + seed / 100)

    report(f"runs={tmp_path / 'sweep'}", f"out={tmp_path / 'out'}")

    summary = (tmp_path / "out/summary.md").read_text()
    assert ("rmsnorm − layernorm (the bias differs too): these runs differ in the bias as well as in the centring"
            in summary)
    assert "Centring × bias" not in summary


DYT = "dyt − layernorm (a point-wise layer in place of layernorm)"  # DyT's comparison with the reference
# the verdict's header before DyT: a report without DyT keeps it
OLD_HEADER = ("| model | norm | runs | step | final val loss, uncentred − centred, paired by seed: mean [95% t "
              "interval] | mean angle to 1 at the norm inputs: the site farthest from 90°, in sds of the same mean "
              "to random directions, against the largest of all sites; beside it the same for the mean cos² along 1, "
              "blind to its sign | largest share of ‖x‖² along 1 at the norm inputs, with its percentile among "
              "random directions' shares | ablation at every norm (centring removed from LN, added to RMS): Δ loss "
              "[95% interval: t over seeds, bootstrap for one run] |")


def test_dyt_is_paired_with_layernorm_by_seed_and_never_with_the_centring(tmp_path):
    losses = {"layernorm": (3.00, 3.10, 3.05), "rmsnorm": (3.02, 3.13, 3.06), "dyt": (3.20, 3.25, 3.35)}  # per seed
    for norm, per_seed in losses.items():
        for seed, loss in enumerate(per_seed):
            make_run(tmp_path / "sweep", f"{norm}-seed{seed}", norm, seed, loss)
    write_ablation(tmp_path / "sweep/dyt-seed0", 0.2, 0.15, 0.25)
    for norm, loss in (("layernorm", 3.0), ("dyt", 3.25)):  # normlab-eval of seed 0's pair
        (tmp_path / f"sweep/{norm}-seed0/eval").mkdir()
        write_csv(tmp_path / f"sweep/{norm}-seed0/eval/results.csv", [
            {"run": f"{norm}-seed0", "model": "tiny", "norm": norm, "seed": 0, "source": "last.ckpt", "step": 10,
             "task": "perplexity_embedded", "metric": "loss", "value": loss, "stderr": "", "count": 100,
             "num_fewshot": 0}], CSV_COLUMNS)

    (group,) = group_runs(find_runs([tmp_path / "sweep"])[0])  # alpha_init and no eps: still the norms' group
    report(f"runs={tmp_path / 'sweep'}", f"out={tmp_path / 'out'}", figures=True)

    assert [a.name for a in group.arms()] == ["layernorm", "rmsnorm", "dyt"]
    assert [r.name for r in group.runs if r.left_out or r.note] == []
    centring, dyt = group.comparisons
    assert (centring.label, centring.centring) == ("rmsnorm − layernorm (the bias differs too)", True)
    assert all(u.norm.traits.normalizes for _, u in centring.pairs)
    assert (dyt.label, dyt.centring) == (DYT, False)
    assert [(c.name, u.name) for c, u in dyt.pairs] == [(f"layernorm-seed{s}", f"dyt-seed{s}") for s in range(3)]
    assert dyt.differences == pytest.approx([0.20, 0.15, 0.30])
    summary = (tmp_path / "out/summary.md").read_text()
    # by hand: 0.20, 0.15, 0.30: mean 0.2167, sd 0.0764, half-width 4.3027 x 0.0764 / sqrt 3 = 0.1897; t = 4.91 on 2
    # df, p 0.039: first of the family of two, at 0.025: ± 6.2053 x 0.0441 = [-0.0570, +0.4903], p 2 x 0.039; the
    # other (p 0.0742) then at 0.05, its adjusted p no smaller than the first's
    assert (f"| tiny† | dyt | 3 | 10 | {DYT}: +0.2167 [+0.0269, +0.4064] (t over 3 seeds, 2 df), Holm [-0.0570, "
            "+0.4903], p 0.078: excludes 0 alone, not after Holm; above 0 in 3 of 3 seeds (sign test p 0.25); 80% "
            "power at ±0.2365 | +0.0 (0 attn, 90.00°)‡§, largest of 5 sites"
            "; sign-invariant: unavailable¶ | 0.0500 (final; 1/d = 0.0156; no percentile¶) | "
            "centred (before its point-wise map): +0.2000 [+0.1500, +0.2500] (bootstrap "
            "over windows); 2 runs not ablated |") in summary
    assert (f"| {DYT} | paired t | 3 (0, 1, 2) | +0.2000, +0.1500, +0.3000 | +0.2167 | [+0.0269, +0.4064] (2 df) "
            "| Holm [-0.0570, +0.4903], p 0.078 | no | 3 of 3 (0.25) | ±0.2365 |") in summary
    assert ("| tiny† | rmsnorm | 3 | 10 | rmsnorm − layernorm (the bias differs too): +0.0200 [-0.0048, +0.0448] "
            "(t over 3 seeds, 2 df), Holm [-0.0048, +0.0448], p 0.078: includes 0;") in summary  # in DyT's family
    assert "| tiny† | layernorm | 3 | 10 | reference |" in summary
    text = " ".join(summary.split())
    assert "final val loss, uncentred − centred (dyt: − layernorm), paired by seed" in text
    assert ("ablation at every norm (centring removed from LN, added to RMS and before the point-wise map of "
            "dyt)") in text
    assert ("rmsnorm − layernorm (the bias differs too): these runs differ in the bias as well as in the centring "
            "(layernorm has a bias β, rmsnorm none)") in text
    assert "in place of layernorm): these runs differ" not in text  # the bias note is the centring's
    assert (f"{DYT}: one norm in place of another, so the loss cell can support a difference in everything the "
            "norm does") in text
    assert ("dyt: no norm, a point-wise layer (it divides its input by no statistic of it); its ablation centres its "
            "inputs before its point-wise map.") in text
    assert "not the centring's effect" in text and "Centring × bias" not in summary
    assert "### Evaluation (normlab-eval), uncentred − centred (dyt: − layernorm), paired by seed" in summary
    assert (f"| {DYT} | perplexity_embedded | loss | 1 (0) | 10/10 | +0.2500 | +0.2500 | no interval: one pair "
            "| — |") in summary
    for figure in ("loss", "loss_difference", "angles_by_layer", "ablation"):
        assert f"({figure}_tiny.png)" in summary


def scalenorm_sweep(root: Path) -> Path:
    """LayerNorm, RMSNorm and a user's ScaleNorm (uncentred and without a bias, as RMSNorm), seeds 0 and 1."""
    for seed, (ln, rms, scale) in enumerate([(3.00, 3.02, 3.05), (3.10, 3.13, 3.12)]):
        make_run(root, f"layernorm-seed{seed}", "layernorm", seed, ln)
        make_run(root, f"rmsnorm-seed{seed}", "rmsnorm", seed, rms)
        user_norm_run(root, f"scalenorm-seed{seed}", seed, scale)
    return root


def test_a_users_norm_beside_rmsnorm_is_no_replicate_and_is_compared_with_the_reference(tmp_path):
    """What a norm is comes from its class (tests/user_norms.py says nothing: normalizing, uncentred, outside the
    2x2): a ScaleNorm run and an RMSNorm run of one seed are two norms, and ScaleNorm is compared with layernorm."""
    sweep = scalenorm_sweep(tmp_path / "sweep")

    (group,) = group_runs(find_runs([sweep])[0])
    report(f"runs={sweep}", f"out={tmp_path / 'out'}")

    assert [r.name for r in group.runs if r.left_out or r.note] == []
    assert [a.name for a in group.arms()] == ["layernorm", "rmsnorm", "scalenorm"]
    traits = group.arms()[2].traits
    assert (traits.centres, traits.normalizes, traits.bias, traits.centring_pair) == (False, True, False, False)
    assert [(c.label, c.differences) for c in group.comparisons] == [
        ("rmsnorm − layernorm (the bias differs too)", pytest.approx([0.02, 0.03])),
        ("scalenorm − layernorm (another norm in place of layernorm; the bias differs too)",
         pytest.approx([0.05, 0.02]))]
    summary = (tmp_path / "out/summary.md").read_text()
    # 0.05, 0.02: mean 0.035, sd 0.0212, half-width 12.7062 x 0.0212 / sqrt 2 = 0.1906
    assert ("| tiny† | scalenorm | 2 | 10 | scalenorm − layernorm (another norm in place of layernorm; the bias "
            "differs too): +0.0350 [-0.1556, +0.2256] (t over 2 seeds, 1 df), Holm [") in summary
    assert "final val loss, uncentred − centred (scalenorm: − layernorm), paired by seed" in summary
    # RMSNorm's 6,540,864 parameters less 63 at each of its 5 norms (one scalar gain for 64)
    assert "| scalenorm-seed1 | scalenorm | 1 | 6,540,549 |" in summary and "point-wise" not in summary


def test_declared_pairs_or_reference_are_what_is_compared_and_a_name_no_run_has_is_one_line(tmp_path):
    sweep = scalenorm_sweep(tmp_path / "sweep")
    by_rmsnorm = "scalenorm − rmsnorm (another norm in place of rmsnorm, both without bias)"

    report(f"runs={sweep}", f"out={tmp_path / 'out'}", "pairs=[[rmsnorm,scalenorm]]")
    (group,) = group_runs(find_runs([sweep])[0], Declared(reference="rmsnorm"))

    summary = (tmp_path / "out/summary.md").read_text()
    table = summary.split("### Final validation loss, paired by seed")[1].split("###")[0]
    assert [row.split(" | ")[0] for row in table.splitlines() if " − " in row] == [f"| {by_rmsnorm}"]  # it alone
    # 0.03, -0.01: mean 0.01, sd 0.0283, half-width 12.7062 x 0.0283 / sqrt 2 = 0.2541
    assert (f"| tiny† | scalenorm | 2 | 10 | {by_rmsnorm}: +0.0100 [-0.2441, +0.2641] (t over 2 seeds, 1 df), "
            "Holm [") in summary and "above 0 in 1 of 2 seeds (sign test p 1)" in summary
    assert "| tiny† | layernorm | 2 | 10 | no pair |" in summary
    assert "| tiny† | rmsnorm | 2 | 10 | reference |" in summary
    assert [(c.label, c.differences) for c in group.comparisons] == [  # the 2x2 as before, then the reference's
        ("rmsnorm − layernorm (the bias differs too)", pytest.approx([0.02, 0.03])),
        (by_rmsnorm, pytest.approx([0.03, -0.01]))]
    for override, message in (
            ("reference=scalenorm_v2", "reference=scalenorm_v2: no run has that norm (the runs' norms: layernorm, "
                                       "rmsnorm, scalenorm)"),
            ("pairs=[[rmsnorm,crmsnorm]]", "pairs names crmsnorm, which no run has (the runs' norms: layernorm, "
                                           "rmsnorm, scalenorm): give pairs=[[a,b],...] of the runs' norm names")):
        with pytest.raises(AnalysisError) as refused:
            report(f"runs={sweep}", f"out={tmp_path / 'refused'}", override)
        assert str(refused.value) == message
    assert not (tmp_path / "refused").exists()  # refused before anything is written


def test_a_norm_class_that_cannot_be_imported_is_one_line_naming_the_run_and_what_to_do(tmp_path):
    make_run(tmp_path / "sweep", "layernorm-seed0", "layernorm")
    run = user_norm_run(tmp_path / "sweep", "scalenorm-seed0", _target_="my_norms.ScaleNorm")

    with pytest.raises(AnalysisError) as refused:
        report(f"runs={tmp_path / 'sweep'}", f"out={tmp_path / 'out'}")

    assert str(refused.value) == (f"{run / 'config.yaml'}: its norm class my_norms.ScaleNorm cannot be imported "
                                  "(ModuleNotFoundError: No module named 'my_norms'): put the folder that holds its "
                                  "module on PYTHONPATH")
    assert not (tmp_path / "out").exists()


def kept_in_order(lines: list[str], within: list[str]) -> bool:
    """Whether every line of `lines` is in `within`, in order, as it was or (a table row) with columns added at its
    end."""
    remaining = iter(within)
    return all(any(other == line or line.startswith("|") and other.startswith(line) for other in remaining)
               for line in lines)


def unadjusted(summary: str) -> list[str]:
    """The lines of summary.md with what depends on the size of the family masked: the Holm-adjusted intervals and
    p, what they say of 0, and the family's size."""
    for pattern in (r"Holm \[[^\]]*\], p [^ :|]+", r"\*\*excludes 0 after Holm\*\*|excludes 0 alone, not after Holm",
                    r"\| (no|\*\*yes\*\*) \| (?=\d+ of)", r"The family: \d+ comparisons"):
        summary = re.sub(pattern, "…", summary)
    return summary.splitlines()


def test_dyt_beside_the_2x2_sweep_is_no_replicate_of_rmsnorm_bias_and_only_adds_to_its_report(tmp_path):
    losses = {"layernorm": (3.000, 3.100), "rmsnorm_bias": (3.030, 3.120), "layernorm_nobias": (3.020, 3.110),
              "rmsnorm": (3.010, 3.115)}  # per seed, as in the 2x2 test
    for norm, per_seed in losses.items():
        for seed, loss in enumerate(per_seed):
            make_run(tmp_path / "sweep", f"{norm}-seed{seed}", norm, seed, loss)
    report(f"runs={tmp_path / 'sweep'}", f"out={tmp_path / 'without'}")
    for seed, loss in enumerate((3.25, 3.05)):  # DyT has a bias and is uncentred, like rmsnorm_bias
        make_run(tmp_path / "sweep", f"dyt-seed{seed}", "dyt", seed, loss)

    (group,) = group_runs(find_runs([tmp_path / "sweep"])[0])
    report(f"runs={tmp_path / 'sweep'}", f"out={tmp_path / 'with'}")

    assert [r.name for r in group.runs if r.left_out] == []
    assert [c.label for c in group.comparisons] == [
        "rmsnorm_bias − layernorm (with bias)", "rmsnorm − layernorm_nobias (without bias)",
        DYT]
    assert all(run.norm.name != "dyt" for c in group.comparisons[:2] for pair in c.pairs for run in pair)
    assert group.comparisons[2].differences == pytest.approx([0.25, -0.05])
    without = unadjusted((tmp_path / "without/summary.md").read_text())
    with_dyt = unadjusted((tmp_path / "with/summary.md").read_text())
    assert OLD_HEADER in without and "dyt" not in " ".join(without).replace(str(tmp_path), "").lower()
    # DyT adds rows, a comparison (to the family, so the Holm-adjusted numbers grow), its note and its columns of the
    # per-layer table; the 2x2 table and every other line stay as they were
    assert kept_in_order([line for line in without if line != OLD_HEADER], with_dyt)
    assert not kept_in_order(without, with_dyt)  # (the header alone names DyT)
    assert "| with | layernorm: 3.0500 | rmsnorm_bias: 3.0750 |" in with_dyt
    assert f"| tiny† | dyt | 2 | 10 | {DYT}: +0.1000 [" in "\n".join(with_dyt)


def test_dyt_without_a_bias_is_compared_with_the_reference_unless_a_pair_is_declared(tmp_path):
    no_bias = {"norm.layer.bias": False}
    make_run(tmp_path, "layernorm_nobias-seed0", "layernorm_nobias", 0, 3.05)
    make_run(tmp_path, "layernorm-seed0", "layernorm", 0, 3.0)
    make_run(tmp_path, "dyt-seed0", "dyt", 0, 3.1, settings=no_bias)

    for declared, label, difference in (
            (Declared(), "dyt − layernorm (a point-wise layer in place of layernorm; the bias differs too)", 0.1),
            (Declared(pairs=(("layernorm_nobias", "dyt"),)),
             "dyt − layernorm_nobias (a point-wise layer in place of layernorm_nobias, both without bias)", 0.05)):
        (group,) = group_runs(find_runs([tmp_path])[0], declared)
        (dyt,) = group.comparisons
        assert dyt.label == label and dyt.differences == pytest.approx([difference])


def test_two_dyt_settings_beside_one_layernorm_stay_groups_of_their_own(tmp_path):
    make_run(tmp_path, "layernorm-seed0", "layernorm", 0)
    make_run(tmp_path, "dyt-seed0", "dyt", 0, 3.1)
    make_run(tmp_path, "dyt-alpha-seed0", "dyt", 0, 3.2, settings={"norm.layer.alpha_init": 0.2})

    groups = group_runs(find_runs([tmp_path])[0])

    assert sorted(tuple(sorted(r.name for r in g.runs)) for g in groups) == [
        ("dyt-alpha-seed0",), ("dyt-seed0",), ("layernorm-seed0",)]  # neither passes for the other's replicate
    assert all(not r.left_out for g in groups for r in g.runs) and all(not g.comparisons for g in groups)
    assert any("norm.layer.alpha_init=0.2" in g.distinct for g in groups)


def test_two_norms_of_one_name_are_two_norms_labelled_by_the_settings_that_differ(tmp_path):
    make_run(tmp_path, "layernorm-seed0", "layernorm", 0, 3.0)
    make_run(tmp_path, "layernorm-nobias-seed0", "layernorm", 0, 3.02, settings={"norm.layer.bias": False})
    make_run(tmp_path, "rmsnorm-seed0", "rmsnorm", 0, 3.05)

    (group,) = group_runs(find_runs([tmp_path])[0])

    assert [r.name for r in group.runs if r.left_out] == []
    assert [group.label(a) for a in group.arms()] == ["layernorm bias=True", "layernorm bias=False", "rmsnorm"]
    assert [(c.label, c.differences) for c in group.comparisons] == [
        ("rmsnorm − layernorm bias=False (without bias)", [pytest.approx(0.03)])]


def test_runs_written_before_classes_and_keys_moved_group_and_pair_with_runs_written_now(tmp_path):
    """config.yaml of a run written before normlab had subpackages names its classes so (normlab.norms.LayerNorm...);
    one written before the seams moved holds model.lr and callbacks.scheduled_checkpoints (common/moved.py)."""
    old = make_run(tmp_path, "ln-seed0-old", "layernorm", 0) / "config.yaml"
    OmegaConf.save(OmegaConf.create(written_before(OmegaConf.to_container(OmegaConf.load(old)))), old)
    assert "normlab.norms.LayerNorm" in old.read_text() and "scheduled_checkpoints" in old.read_text()
    make_run(tmp_path, "ln-seed1", "layernorm", 1)
    for seed in (0, 1):
        make_run(tmp_path, f"rms-seed{seed}", "rmsnorm", seed, loss=3.1)

    (group,) = group_runs(find_runs([tmp_path])[0])

    assert [a.name for a in group.arms()] == ["layernorm", "rmsnorm"]
    assert [r.name for r in group.runs if r.left_out] == []
    (comparison,) = group.comparisons
    assert [(c.name, u.name) for c, u in comparison.pairs] == [("ln-seed0-old", "rms-seed0"), ("ln-seed1", "rms-seed1")]


def test_the_norm_keys_of_older_configs_are_ignored_for_what_the_class_says(tmp_path):
    """Configs written before the class said what a norm is hold norm.centred, norm.normalizes and norm.bias (or,
    before those, nothing beside the name): the report reads the class, even where a key says otherwise."""
    keys = {"layernorm": {"centred": True, "bias": True}, "rmsnorm": {"centred": True, "bias": True},  # (wrong)
            "dyt": {"centred": False, "normalizes": True, "bias": False}}
    for norm, loss in (("layernorm", 3.0), ("rmsnorm", 3.1), ("dyt", 3.2)):
        make_run(tmp_path / "old", norm, norm, loss=loss, norm_keys=keys[norm])
        make_run(tmp_path / "new", norm, norm, loss=loss)

    old, new = (group_runs(find_runs([tmp_path / kind])[0]) for kind in ("old", "new"))

    assert [(c.label, c.differences) for (g,) in (old, new) for c in g.comparisons] == 2 * [
        ("rmsnorm − layernorm (the bias differs too)", [pytest.approx(0.1)]),
        ("dyt − layernorm (a point-wise layer in place of layernorm)", [pytest.approx(0.2)])]
    assert [r.name for (g,) in (old, new) for r in g.runs if r.left_out] == []


def test_pretrained_models_csvs_get_figures_and_verdict_rows(tmp_path):
    new = {"run": "gpt2-small", "model": "gpt2", "norm": "layernorm", "seed": "", "source": "/models/gpt2-small"}
    write_csv(tmp_path / "gpt2.csv", angle_rows(0, 91.0, 0.02, null_random_sd=0.5, **new), NEW_COLUMNS)
    write_csv(tmp_path / "pythia-70m.csv", angle_rows(0, 89.0, 0.03), OLD_COLUMNS)
    write_csv(tmp_path / "gpt2-ablation.csv", [{"run": "gpt2-small", "model": "gpt2", "step": 0, "site": "all",
                                                 "ablation": "uncentred", "delta": 0.005, "ci_low": 0.004,
                                                 "ci_high": 0.006}], ABLATION_COLUMNS)

    report(f"runs=[{tmp_path / 'pythia-70m.csv'}]", f"csvs=[{tmp_path / 'gpt2.csv'},{tmp_path / 'gpt2-ablation.csv'}]",
           f"out={tmp_path / 'out'}", figures=True)

    summary = (tmp_path / "out/summary.md").read_text()
    # the angle: (91 - 90) / 0.5 null sd
    assert ("| gpt2-small (pretrained) | layernorm | 1 | 0 | pretrained: no loss comparison | +2.0 (final, 91.00°)§, "
            "largest of 5 sites; sign-invariant: unavailable¶ | 0.0200 (final; 1/d = 0.0156; no percentile¶) | "
            "uncentred: +0.0050 [+0.0040, +0.0060] (bootstrap over windows) |") in summary
    assert ("| pythia-70m (pretrained) | norm not recorded | 1 | 0 | pretrained: no loss comparison | "
            "-14.0 (final, 89.00°)‡§, largest of 5 sites") in summary
    assert "not run (normlab-ablate model_path=<the model's directory>)" in summary
    for name in ("angles_by_layer_pretrained-gpt2-small", "references_pretrained-pythia-70m",
                 "ablation_pretrained-gpt2-small"):
        assert (tmp_path / f"out/{name}.pdf").is_file() and f"({name}.png)" in summary


def plant(path: Path, where: dict, column: str, value: str) -> None:
    """Set `column` to `value` in the rows of the CSV at `path` whose columns hold the values of `where`."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows, columns = list(reader), reader.fieldnames
    for row in rows:
        if all(row[k] == str(v) for k, v in where.items()):
            row[column] = value
    write_csv(path, rows, columns)


def test_values_that_are_not_finite_are_named_once_per_file_and_left_out_of_every_number(tmp_path, capsys):
    """nan and inf planted in an RMS run's angles.csv (the mean angle of a site, which must not pass for the most
    extreme one) and metrics.csv (a training loss), in another's ablation.csv, and as the final validation loss of a
    third, which leaves that run out of the loss comparison with its reason."""
    sweep = tmp_path / "sweep"
    for seed in (0, 1, 2):
        make_run(sweep, f"ln-seed{seed}", "layernorm", seed, 3.0)
        angles_with_direction_means(make_run(sweep, f"rms-seed{seed}", "rmsnorm", seed, 3.01 + seed / 100),
                                    {"2.final_norm.input": 91.0}, seed)
    plant(sweep / "rms-seed0/angles.csv", {"site": "attn_norm.input", "layer": 0, "reference": "uniform"},
          "mean_deg", "nan")
    plant(sweep / "rms-seed0/metrics.csv", {"step": 3}, "train/loss", "inf")
    write_ablation(sweep / "rms-seed1", 0.01, 0.008, 0.012, site_delta=math.nan)
    plant(sweep / "rms-seed2/metrics.csv", {"step": 9, "train/loss": ""}, "val/loss", "nan")

    report(f"runs={sweep}", f"out={tmp_path / 'out'}")

    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: {sweep}/rms-seed0/metrics.csv: left out of the report, as not finite or missing: train/loss at "
        "step 3",
        f"warning: {sweep}/rms-seed0/angles.csv: left out of the report, as not finite or missing: mean_deg at step "
        "10 (those rows)",
        f"warning: {sweep}/rms-seed1/ablation.csv: left out of the report, as not finite or missing: delta at step 10 "
        "(those rows)",
        f"warning: {sweep}/rms-seed2/metrics.csv: left out of the report, as not finite or missing: val/loss at step "
        "9"]
    summary = (tmp_path / "out/summary.md").read_text()
    assert not re.search(r"\b(nan|inf)\b", summary, re.IGNORECASE)
    assert "| rms-seed2 | rmsnorm | 2 |" in summary
    assert "**final val loss (after step 10) not finite in metrics.csv: left out**" in summary
    # seeds 0 and 1 paired: 0.01 and 0.02
    assert ("| rmsnorm − layernorm (the bias differs too) | paired t | 2 (0, 1) | +0.0100, +0.0200 | +0.0150 |"
            in summary)
    (row,) = [line for line in summary.splitlines() if line.startswith("| tiny† | rmsnorm |")]
    angle = row.split(" | ")[5]  # seed 0 lacks a site now: the largest of the sites without the null of the largest
    assert angle.startswith("+8.6 (final, 91.00°)§, largest of 5 sites")  # not the site left out: 0 attn
    assert "centred: +0.0100 [+0.0080, +0.0120] (bootstrap over windows); 1 run not ablated |" in row


def converted(root: Path, name: str, step: int = 10) -> Path:
    """A run directory as normlab-convert writes it: config.yaml with `converted_from` and one checkpoint (here
    empty: the report does not read it), no metrics.csv."""
    run_dir = root / name
    (run_dir / "checkpoints").mkdir(parents=True)
    cfg = composed("rmsnorm_bias")
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir, cfg.converted_from = str(run_dir), {"command": "normlab-convert", "path": "/models/ln", "step": step}
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    (run_dir / "checkpoints" / f"step-{step:07d}.ckpt").write_bytes(b"")
    (run_dir / "checkpoints" / f"step-{step:07d}.ckpt.json").write_text(json.dumps({"step": step}))
    return run_dir


def test_a_converted_run_among_the_runs_is_listed_as_left_out_with_the_commands_for_its_angles(tmp_path):
    sweep = tmp_path / "sweep"
    make_run(sweep, "ln-seed0", "layernorm", 0, 3.0)
    run_dir = converted(sweep, "ln-rms")

    report(f"runs={sweep}", f"out={tmp_path / 'out'}")

    summary = (tmp_path / "out/summary.md").read_text()
    assert ("\n\nLeft out, with no training metrics (metrics.csv) to compare:\n"
            f"- `{run_dir}`: converted by normlab-convert from `/models/ln`; its angles enter as a pretrained model's: "
            f"`normlab-angles model_path={run_dir}`, then that CSV in csvs=[...]\n\n## tiny\n") in summary
    assert "| ln-seed0 | layernorm | 0 |" in summary and "| ln-rms |" not in summary
