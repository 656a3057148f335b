"""normlab-report's choice of what is compared with what, on synthetic run directories (tests/test_report.py's
make_run): runs grouped by their settings, never by their names; the centring x bias 2x2 and the paper's pair; DyT and
a user's norm against the reference; declared pairs; norms of one name; configs written by older normlab."""

import csv
import re
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import written_before
from normlab.interop.evaluate import CSV_COLUMNS
from normlab.probe.table import AnalysisError
from normlab.study.report.groups import Declared, group_runs, screen
from normlab.study.report.runs import find_runs
from test_report import make_run, per_seed_table, report, user_norm_run, write_ablation, write_csv


def test_screening_and_pairing_are_pure_functions_of_the_runs(tmp_path):
    """screen() gives each run left out its reason (unfinished, a replicate, did not learn) as a copy, and pairs the
    rest; group_runs changes nothing it is given (the runs as read are frozen), and the same runs give the same frozen
    groups twice."""
    for seed in (0, 1):
        make_run(tmp_path / "a", f"tiny-layernorm-seed{seed}", "layernorm", seed, 3.0)
        make_run(tmp_path / "a", f"tiny-rmsnorm-seed{seed}", "rmsnorm", seed, 3.01)
    make_run(tmp_path / "b", "tiny-rmsnorm-seed0", "rmsnorm", 0, 3.02, steps=6)  # unfinished
    make_run(tmp_path / "c", "tiny-layernorm-seed1", "layernorm", 1, 3.0)  # a replicate of a's
    runs, _ = find_runs([tmp_path])
    screened = screen(runs, learning_check="bigram")
    reasons = {r.name: r.left_out for r in screened.runs if r.left_out}
    assert reasons == {"b/tiny-rmsnorm-seed0": "unfinished: step 6 of 10: left out",
                       "c/tiny-layernorm-seed1": "same settings, norm and seed as a/tiny-layernorm-seed1: a "
                                                 "replicate, left out"}
    assert all(not r.left_out and not r.note for r in runs)  # the runs given: unchanged
    assert sorted(len(kept) for kept in screened.kept.values()) == [2, 2]
    first, second = group_runs(runs), group_runs(runs)
    assert [(g.settings, [r.left_out for r in g.runs], [c.label for c in g.comparisons]) for g in first] == [
        (g.settings, [r.left_out for r in g.runs], [c.label for c in g.comparisons]) for g in second]
    with pytest.raises(FrozenInstanceError):
        first[0].comparisons = ()
    with pytest.raises(FrozenInstanceError):  # a run as read is data too: screening makes copies
        runs[0].left_out = "changed"
    assert all(not r.left_out for r in runs)


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
    # a group set apart by more than one setting (the first: by max_steps and the lr) is named by a hash of them
    assert any("," in g.distinct for g in groups)
    assert len({g.slug for g in groups}) == 3 and all(re.fullmatch(r"tiny-[0-9a-f]{8}", g.slug) for g in groups)
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
    assert ("centring, averaged over bias (uncentred − centred): +0.0112 [-0.0007, +0.0232] (t over 2 seeds, 3 df), "
            "simultaneous [-0.0107, +0.0332], Holm p 0.17") in summary  # the verdict's primary sentence
    # none of the 5 rejected: every simultaneous interval at 0.05 / 5 (± 5.1765 x 0.00375 for the centring)
    assert "| tiny | centring (2x2) ★ | 2 | +0.0112 | [-0.0007, +0.0232] | [-0.0107, +0.0332] | 0.17 | 2 |" in summary
    assert "| tiny | centring × bias | 2 | +0.0275 | [+0.0036, +0.0514] |" in summary
    assert ("Their effects, the verdict's (2x2) rows with their intervals and tests: centring, averaged over bias "
            "(uncentred − centred): +0.0112;") in " ".join(summary.split())  # named below the cells, not repeated
    assert summary.count("[-0.0007, +0.0232]") == 2  # the verdict's sentence and row, not a third time
    # the per-seed table: a column per comparison, a row per seed
    assert per_seed_table(summary) == {"rmsnorm_bias − layernorm (with bias)": ["+0.0300", "+0.0200", "+0.0250"],
                                       "rmsnorm − layernorm_nobias (without bias)": ["-0.0100", "+0.0050", "-0.0025"]}
    # each cell pair's interval on the pooled residual's 3 df, not a paired t's 1
    assert "| tiny | rmsnorm_bias − layernorm | 2 | +0.0250 | [+0.0081, +0.0419] |" in summary
    assert "| tiny | rmsnorm − layernorm_nobias | 2 | -0.0025 | [-0.0194, +0.0144] |" in summary
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
    assert "The family: 1 comparison with an interval, Holm-adjusted together" in summary


DYT = "dyt − layernorm (a point-wise layer in place of layernorm)"  # DyT's comparison with the reference
# the verdict's header before DyT: a report without DyT keeps it
TABLE_HEADER = "| model | comparison | n | Δ | 95% CI | simult. CI | p Holm | >0 | MDE |"


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
    # df, p 0.039; rmsnorm − layernorm p 0.0742. Neither rejected (2 x 0.039 > 0.05): both simultaneous intervals at
    # 0.05 / 2: ± 6.2053 x 0.0441 = [-0.0570, +0.4903] and ± 6.2053 x 0.00577 = [-0.0158, +0.0558] (the interval once
    # called Holm's gave the second its raw [-0.0048, +0.0448]); Holm p 2 x 0.039 for both (step-down)
    assert "| tiny | dyt − layernorm | 3 | +0.2167 | [+0.0269, +0.4064] | [-0.0570, +0.4903] | 0.078 | 3 |" in summary
    assert ("| tiny | rmsnorm − layernorm | 3 | +0.0200 | [-0.0048, +0.0448] | "
            "[-0.0158, +0.0558] | 0.078 | 3 |") in summary
    assert "| tiny | dyt | 3 | 10 | 0 | — | — | — | 0.0500 | — | +0.2000 | [+0.1500, +0.2500] |" in summary
    assert ("Ablation: centred (before its point-wise map): +0.2000 [+0.1500, +0.2500] (bootstrap over windows); 2 "
            "runs not ablated.") in summary
    assert per_seed_table(summary)[DYT] == ["+0.2000", "+0.1500", "+0.3000", "+0.2167"]  # the seeds, their mean
    text = " ".join(summary.split())
    assert "### Evaluation (normlab-eval), uncentred − centred (dyt: − layernorm), paired by seed" in summary
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
    assert ("| tiny | scalenorm − layernorm | 2 | +0.0350 | [-0.1556, +0.2256] | "
            "[-0.3468, +0.4168] | 0.26 | 2 |") in summary
    assert per_seed_table(summary)["scalenorm − layernorm (another norm in place of layernorm; the bias differs "
                                   "too)"] == ["+0.0500", "+0.0200", "+0.0350"]
    # RMSNorm's 6,540,864 parameters less 63 at each of its 5 norms (one scalar gain for 64)
    assert "| scalenorm-seed1 | scalenorm | 1 | 6,540,549 |" in summary and "point-wise" not in summary


def test_the_default_reference_is_the_centred_norm_with_a_bias_whatever_its_name(tmp_path):
    """No name is the reference: LayerNorm's class under a name of the user's is the 2x2's centred norm with a bias,
    and the norm outside the 2x2 is compared with it; without such a norm, with nothing."""
    for seed, (ln, rms, scale) in enumerate([(3.00, 3.02, 3.05), (3.10, 3.13, 3.12)]):
        make_run(tmp_path / "sweep", f"ln-seed{seed}", "layernorm", seed, ln, norm_keys={"name": "my_layernorm"})
        make_run(tmp_path / "sweep", f"rmsnorm-seed{seed}", "rmsnorm", seed, rms)
        user_norm_run(tmp_path / "sweep", f"scalenorm-seed{seed}", seed, scale)

    (group,) = group_runs(find_runs([tmp_path / "sweep"])[0])
    (without,) = group_runs([r for r in find_runs([tmp_path / "sweep"])[0] if r.norm.name != "my_layernorm"])

    assert [(c.label, c.differences) for c in group.comparisons] == [
        ("rmsnorm − my_layernorm (the bias differs too)", pytest.approx([0.02, 0.03])),
        ("scalenorm − my_layernorm (another norm in place of my_layernorm; the bias differs too)",
         pytest.approx([0.05, 0.02]))]
    assert without.comparisons == ()


def test_declared_pairs_or_reference_are_what_is_compared_and_a_name_no_run_has_is_one_line(tmp_path):
    sweep = scalenorm_sweep(tmp_path / "sweep")
    by_rmsnorm = "scalenorm − rmsnorm (another norm in place of rmsnorm, both without bias)"

    report(f"runs={sweep}", f"out={tmp_path / 'out'}", "pairs=[[rmsnorm,scalenorm]]")
    (group,) = group_runs(find_runs([sweep])[0], Declared(reference="rmsnorm"))

    summary = (tmp_path / "out/summary.md").read_text()
    assert list(per_seed_table(summary)) == [by_rmsnorm]  # it alone
    # 0.03, -0.01: mean 0.01, sd 0.0283, half-width 12.7062 x 0.0283 / sqrt 2 = 0.2541
    assert ("| tiny | scalenorm − rmsnorm | 2 | +0.0100 | [-0.2441, +0.2641] | "
            "[-0.2441, +0.2641] | 0.7 | 1 |") in summary
    assert per_seed_table(summary)[by_rmsnorm] == ["+0.0300", "-0.0100", "+0.0100"]
    (row,) = csv.DictReader(open(tmp_path / "out/verdict_comparisons.csv"))
    assert (row["above_0"], row["sign_test_p"]) == ("1", "1.0")  # its seeds above 0 and their sign test
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

    assert str(refused.value) == (f"{run / 'config.yaml'}: its norm class my_norms.ScaleNorm cannot be imported: "
                                  "no module my_norms on the Python path: put the folder that holds my_norms.py on "
                                  "PYTHONPATH, or check the spelling")
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
    for pattern in (r"simultaneous \[[^\]]*\], Holm p [^ :|]+", r"\*\*excludes 0 after Holm\*\*|excludes 0 alone, "
                    r"not after Holm", r"\| (no|\*\*yes\*\*) \| (?=\d+ of)", r"The family: \d+ comparisons",
                    r"after Holm at ±[^ |)]+", r"\| ±[^ |]+ \|", r"all \d+ of the family", r"0\.05/\d+",
                    r"(?<=\] \| )\[[^\]]*\] \| [^|]+ \| \d+ \| [^|]+ \|$"):  # a verdict row's simultaneous CI, p, MDE
        summary = re.sub(pattern, "…", summary, flags=re.MULTILINE)
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
    assert TABLE_HEADER in without and "dyt" not in " ".join(without).replace(str(tmp_path), "").lower()
    # DyT adds rows, a comparison (to the family, so the Holm-adjusted numbers grow), its note and its columns of the
    # per-layer table; the 2x2 table and every other line stay as they were
    assert kept_in_order(without, with_dyt)
    assert "| with | layernorm: 3.0500 | rmsnorm_bias: 3.0750 |" in with_dyt
    assert any(line.startswith("| tiny | dyt − layernorm | 2 | +0.1000 |") for line in with_dyt)


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
    one written before the seams moved holds model.lr and callbacks.scheduled_checkpoints (common/moved.py); one
    written before branches has no branch.step, which is None in a run written since."""
    old = make_run(tmp_path, "ln-seed0-old", "layernorm", 0) / "config.yaml"
    config = written_before(OmegaConf.to_container(OmegaConf.load(old)))
    del config["branch"]
    OmegaConf.save(OmegaConf.create(config), old)
    assert "normlab.norms.LayerNorm" in old.read_text() and "scheduled_checkpoints" in old.read_text()
    assert "branch:" not in old.read_text()
    make_run(tmp_path, "ln-seed1", "layernorm", 1)
    for seed in (0, 1):
        make_run(tmp_path, f"rms-seed{seed}", "rmsnorm", seed, loss=3.1)
    assert OmegaConf.load(tmp_path / "rms-seed0/config.yaml").branch.step is None

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


def test_a_folder_of_links_to_chosen_runs_is_reported_each_run_once(tmp_path):
    """runs=DIR where DIR holds symbolic links to the runs chosen (and a link that loops back to DIR): every run is
    found once, as through its real directory."""
    for norm in ("layernorm", "rmsnorm"):
        for seed in (0, 1):
            make_run(tmp_path / "all", f"{norm}-seed{seed}", norm, seed=seed, loss=3.0 + 0.01 * seed)
    chosen = tmp_path / "chosen"
    chosen.mkdir()
    for name in ("layernorm-seed0", "rmsnorm-seed0", "layernorm-seed1", "rmsnorm-seed1"):
        (chosen / name).symlink_to(tmp_path / "all" / name)
    (chosen / "loop").symlink_to(chosen)
    runs, _ = find_runs([chosen])
    assert sorted(r.dir.resolve() for r in runs) == sorted(p.resolve() for p in (tmp_path / "all").iterdir())
    report(f"runs={chosen}", f"out={tmp_path / 'out'}")
    assert "rmsnorm − layernorm" in (tmp_path / "out" / "summary.md").read_text()


def test_a_comparison_named_twice_in_pairs_is_refused(tmp_path):
    make_run(tmp_path / "sweep", "layernorm-seed0", "layernorm")
    make_run(tmp_path / "sweep", "rmsnorm-seed0", "rmsnorm")
    with pytest.raises(AnalysisError) as refused:
        report(f"runs={tmp_path / 'sweep'}", f"out={tmp_path / 'out'}",
               "pairs=[[layernorm,rmsnorm],[rmsnorm,layernorm]]")
    assert str(refused.value) == ("pairs names the comparison of rmsnorm and layernorm twice ([layernorm,rmsnorm] and "
                                  "[rmsnorm,layernorm]): give each pair once (b − a and a − b are one "
                                  "comparison, its sign turned)")
    assert not (tmp_path / "out").exists()
