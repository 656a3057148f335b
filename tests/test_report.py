"""normlab-report on synthetic run directories: real configs (composed from conf/), metrics.csv and angles.csv written
here with known values, so that the pairing, the confidence interval and the verdict are checked against numbers
computed by hand. No training: each test takes seconds."""

import copy
import csv
import json
import math
import re
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from omegaconf import OmegaConf

from conftest import compose_config
from normlab.probe.table import REFERENCES, AnalysisError
from normlab.study.report import main
from normlab.study.report.figures import NULL_LABEL, ablation_figure
from normlab.study.report.groups import group_runs
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


def per_seed_table(summary: str) -> dict[str, list[str]]:
    """The table below the verdict of each comparison's difference per seed: by comparison, its cells down the seeds
    and their mean (the last)."""
    table = summary.split("### Final validation loss, paired by seed")[1].split("\n\n")[1]
    header, _, *rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()]
    return {label: [row[k] for row in rows] for k, label in enumerate(header) if k}


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
                   step: int = 10, null: list[float] = (), **columns) -> None:
    """ablation.csv as normlab-ablate writes it for an RMS run: its inputs centred at one norm (`site_delta`, default
    delta / 2), and at all; with `null`, the deltas of every norm at once along random directions (as it writes them
    since it has a null: a direction column)."""
    site = delta / 2 if site_delta is None else site_delta
    rows = [{"site": "layer00.attn_norm", "layer": 0, "role": "attn_norm", "delta": site, "ci_low": site - 0.001,
             "ci_high": site + 0.001},
            {"site": "all", "layer": "", "role": "", "delta": delta, "ci_low": low, "ci_high": high}]
    rows += [{"site": "all", "layer": "", "role": "", "delta": v, "ci_low": v - 0.001, "ci_high": v + 0.001,
              "direction": f"random {k}"} for k, v in enumerate(null)]
    if null:
        columns = {"direction": "1", **columns}
    write_csv(run_dir / "ablation.csv", [{"step": step, "ablation": "centred", **columns, **r} for r in rows],
              ABLATION_COLUMNS + list(columns))


def report(*args: str, figures: bool = False, wandb: bool = False) -> None:
    """normlab-report with `args`; its figures and wandb run only where a test reads them (drawing them is most of
    its time)."""
    main(compose_config("report", [*args, f"figures={str(figures).lower()}", f"wandb={str(wandb).lower()}"]))


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
    # in its family (its simultaneous interval is the same); 3 of 3 above 0: sign test 0.25; 80% power at 0.0326
    # (the exact noncentral t at 0.05, se 0.00577 on 2 df; the t-quantile formula said 0.0310)
    assert ("| tiny | rmsnorm − layernorm | 3 | +0.0200 | [-0.0048, +0.0448] | [-0.0048, +0.0448] | 0.074 | 3 | "
            "0.0326 |") in summary
    assert per_seed_table(summary) == {  # each seed's difference below the verdict, then their mean
        "rmsnorm − layernorm (the bias differs too)": ["+0.0200", "+0.0300", "+0.0100", "+0.0200"]}
    assert "| tiny-rmsnorm-seed3 | rmsnorm | 3 |" in summary and "| 6 of 10 |" in summary
    assert "**unfinished: step 6 of 10: left out**" in summary
    assert "Final val loss: the mean of a run's last 1 validation (step 10)." in summary  # of the compared runs
    assert "tiny-layernorm-seed3 | layernorm | 3 |" in summary and "no run of the other norm with its seed" in summary
    assert "tiny-rmsnorm-seed1.replaced-20250101-000000" in summary.split("## tiny")[0]  # listed as skipped
    assert "9.9" not in summary
    # the final norm's input at 91 degrees: 1 / (7.16 / sqrt(10000)) = +14.0 null sds of independent tokens (‡)
    assert ("| tiny | rmsnorm | 3 | 10 | +14.0 | — | — | — | 0.0500 | — | +0.0123 | [+0.0100, +0.0146] "
            "|") in summary
    assert ("angles: +14.0 (final, 91.00°)‡§, largest of 5 sites; sign-invariant: unavailable¶. Share along "
            "1: 0.0500 (final; 1/d = 0.0156; no percentile¶). Ablation: centred: +0.0123 [+0.0100, +0.0146] "
            "(bootstrap over windows); 2 runs not ablated.") in summary
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
    assert "rmsnorm − layernorm" in (out / "summary.md").read_text() and (out / "verdict_comparisons.csv").is_file()
    assert not list(out.glob("*.png")) and not list(out.glob("*.pdf")) and "![" not in (out / "summary.md").read_text()
    assert "wrote summary.md, no figures (figures=false) and its numbers" in capsys.readouterr().out
    for option in ("figures", "wandb"):
        with pytest.raises(AnalysisError, match=rf"^{option}=maybe: give true or false$"):
            main(compose_config("report", [f"runs={tmp_path / 'sweep'}", f"{option}=maybe", f"out={tmp_path / 'x'}"]))
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
    assert "| tiny | rmsnorm | 2 | 10 | 0 | — | — | — | 0.0500 | — | +0.0200 | [-0.1071, +0.1471] |" in summary
    assert ("Ablation: centred: +0.0200 [-0.1071, +0.1471] (t over 2 seeds) (step 8, 10); per seed: seed 0 +0.0100 "
            "[+0.0080, +0.0120] (bootstrap over windows), seed 1 +0.0300 [+0.0250, +0.0350] (bootstrap over blocks of "
            "4096 tokens); sign changes between seeds at 1 of 1 sites (layer00.attn_norm).") in summary
    assert "mean of 2 seeds" not in summary  # the range of two seeds is no interval


def test_the_ablations_null_gives_its_percentile_per_seed_and_over_seeds_in_the_tables_csvs_and_figure(tmp_path):
    """Two RMS seeds ablated with a null of four random directions (the same directions in both): seed 0's along-1
    delta above 3 of them, seed 1's above 1; over seeds the mean delta 0.02 against each direction's mean."""
    nulls = {0: [0.001, 0.002, 0.003, 0.05], 1: [0.001, 0.04, 0.05, 0.06]}
    for seed in (0, 1):
        make_run(tmp_path / "sweep", f"ln-seed{seed}", "layernorm", seed, 3.0)
        make_run(tmp_path / "sweep", f"rms-seed{seed}", "rmsnorm", seed, 3.01)
        write_ablation(tmp_path / "sweep" / f"rms-seed{seed}", 0.01 + 0.02 * seed, 0.0, 0.05, null=nulls[seed])
    report(f"runs={tmp_path / 'sweep'}", f"out={tmp_path / 'out'}", figures=True)
    summary = (tmp_path / "out/summary.md").read_text()
    # per direction, the mean over seeds: 0.001, 0.021, 0.0265, 0.055; the mean along 1, 0.02: above 1 of 4
    assert "| +0.0200 | [-0.1071, +0.1471] | 25 |" in summary
    median = f"{(0.021 + 0.0265) / 2:+.4f}"
    assert (f"(t over 2 seeds), at the 25th percentile of the same ablation along 4 random directions (their median "
            f"{median}); per seed (bootstrap over windows): seed 0 +0.0100 [+0.0000, +0.0500] (pct 75), seed 1 "
            "+0.0300 [+0.0000, +0.0500] (pct 25)") in summary  # one unit: said once
    with open(tmp_path / "out/verdict_norms.csv") as f:
        (rms,) = [r for r in csv.DictReader(f) if r["norm"] == "rmsnorm"]
    assert (float(rms["ablation_null_pct"]), rms["ablation_null_directions"]) == (25.0, "4")
    with open(tmp_path / "out/ablations.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["run"] == "rms-seed1"]
    assert [r["direction"] for r in rows] == ["1", "1", "random 0", "random 1", "random 2", "random 3"]
    fig = ablation_figure("tiny", group_runs(find_runs([tmp_path / "sweep"])[0])[0].series())
    (ax,) = fig.axes
    (marks,) = [line for line in ax.get_lines() if line.get_label() == "_null"]
    assert sorted(marks.get_ydata()) == sorted(nulls[0] + nulls[1])  # every direction of every seed, beside "all"
    assert NULL_LABEL in [t.get_text().replace("\n", " ") for t in fig.legends[0].get_texts()]
    plt.close(fig)


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
    (row,) = [line for line in summary.splitlines() if line.startswith("- tiny†, rmsnorm (")]
    # the final norm's input 1 degree off 90 in both seeds: about 7 sds of the average of two runs' direction means
    # (0.2 / sqrt 2), beyond every one of the 39 directions' largest site: p = 1 / 40
    # seed 1, picked as the more extreme of 2 runs: 1 - (1 - 0.025)^2 = 0.049
    found = re.search(r"angles: signed: \+(\d+\.\d) at final \(91\.00°\), largest of 5 sites: p 0\.025 \(5% "
                      r"threshold (\d\.\d); 39 directions\); most extreme run: seed 1, \+(\d+\.\d) at 0 attn "
                      r"\(p 0\.025 for one run; 0\.049 for the most extreme of 2, Šidák\); sign-invariant: "
                      r"unavailable¶\. ", row)
    assert found, row
    z, threshold, seed_z = map(float, found.groups())
    assert 5 < z < 10 and 2 < threshold < 4 and 6 < seed_z < 11  # 1.6 / 0.2 = 8 for seed 1 alone
    assert f"| tiny | rmsnorm | 2 | 10 | +{z:.1f} | 0.025 | — | — |" in summary  # the verdict's table: its numbers
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
    (row,) = [line for line in summary.splitlines() if line.startswith("- tiny†, rmsnorm (")]
    angle, share = re.search(r"angles: (.*)\. Share along 1: (.*)\. Ablation: ", row).groups()
    signed = re.match(r"signed: [+-]\d+\.\d at [^:]+: p (\d\.\d{3}) \(5% threshold \d\.\d; 99 directions\); most "
                      r"extreme run: seed [01], [+-]\d+\.\d at 1 attn \(p 0\.010 for one run; 0\.020 for the most "
                      r"extreme of 2, Šidák\); sign-invariant, mean cos² along 1 \(Stouffer over 2 runs\): "
                      r"\+(\d+\.\d) at 1 attn, largest of 5 sites: p 0\.010 \(5% threshold \d\.\d\)$", angle)
    assert signed, angle
    assert float(signed[1]) > 0.05 and float(signed[2]) > 3  # the signed average cancels; cos² does not
    (numbers,) = [line for line in summary.splitlines() if line.startswith("| tiny | rmsnorm |")]
    assert numbers.split(" | ")[5:10] == [signed[1], f"+{signed[2]}", "0.010", share[:6], "100"]
    assert re.fullmatch(r"0\.\d{4} \(1 attn\): percentile 100\.0 of 99 random directions' shares there \(their "
                        r"median 0\.\d{4}; 1/d = 0\.0312\)", share), share
    assert "¶" not in row and "¶ no sign-invariant statistic" in summary  # the LayerNorm runs' files lack it


def test_angles_of_another_step_than_the_loss_say_so(tmp_path):
    make_run(tmp_path / "sweep", "ln-seed0", "layernorm", 0, 3.0)
    angles_with_direction_means(make_run(tmp_path / "sweep", "rms-seed0", "rmsnorm", 0, 3.01), {}, 0, step=8)

    report(f"runs={tmp_path / 'sweep'}", f"out={tmp_path / 'out'}")

    (row,) = [line for line in (tmp_path / "out/summary.md").read_text().splitlines()
              if line.startswith("- tiny†, rmsnorm (")]
    assert "step 10)" in row and "39 directions) (step 8);" in row  # the loss of step 10, the angles of step 8


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
    assert ("| gpt2-small (pretrained) | layernorm | 1 | 0 | +2.0 | — | — | — | 0.0200 | — | +0.0050 | "
            "[+0.0040, +0.0060] |") in summary
    assert ("- gpt2-small (pretrained), layernorm (step 0; no loss comparison): angles: +2.0 (final, 91.00°)§, "
            "largest of 5 sites; sign-invariant: unavailable¶. Share along 1: 0.0200 (final; 1/d = 0.0156; no "
            "percentile¶). Ablation: uncentred: +0.0050 [+0.0040, +0.0060] (bootstrap over windows).") in summary
    assert ("- pythia-70m (pretrained), norm not recorded (step 0; no loss comparison): angles: -14.0 (final, "
            "89.00°)‡§, largest of 5 sites") in summary
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
    per_seed = per_seed_table(summary)
    assert per_seed == {"rmsnorm − layernorm (the bias differs too)": ["+0.0100", "+0.0200", "+0.0150"]}
    (row,) = [line for line in summary.splitlines() if line.startswith("- tiny†, rmsnorm (")]
    # seed 0 lacks a site now: the largest of the sites without the null of the largest; not the site left out (0 attn)
    assert "angles: +8.6 (final, 91.00°)§, largest of 5 sites" in row
    assert "centred: +0.0100 [+0.0080, +0.0120] (bootstrap over windows); 1 run not ablated." in row
    assert ("| tiny | rmsnorm | 2 | 10 | +8.6 | — | — | — | 0.0156 | — | +0.0100 | [+0.0080, +0.0120] "
            "|") in summary


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
