"""normlab-report on groups of branches (docs/branch.md), planted run directories whose answer is known: the
branches of one step K paired by (source, seed), the converted − LayerNorm difference, the zero-mean-writers control
and the LayerNorm branch against its source continuing (read from branch.source), each at every validation from K and
at the end in the report's Holm family; each arm's share along 1 over the rest of training, measured by the real
probe on constructed inputs; a figure per K."""

import csv
import math
import re
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from normlab.study.report.contrasts import family, group_family, primary_of
from normlab.study.report.figures import STYLE, branch_figure, loss_differences_figure, losses_figure
from normlab.study.report.groups import group_runs
from normlab.study.report.intervals import simultaneous
from normlab.study.report.runs import find_runs
from test_angle_shares import PLANTED, measured_table, seed_inputs
from test_report import make_run, report, write_csv
from test_report_figures import assert_readable

MAX, SEEDS = 8, (0, 1, 2)
ARMS = {"layernorm": ("layernorm", False), "rmsnorm_bias": ("rmsnorm_bias", False), "control": ("rmsnorm_bias", True)}


def source_loss(seed: int, step: int) -> float:
    return 5.0 - 0.1 * step + 0.01 * seed


def branch_loss(arm: str, seed: int, step: int, k: int) -> float:
    """Planted: the LayerNorm branch 0.02 + 0.001 seed above its source after K (the restart), the converted branch
    (0.05 + 0.002 seed) (step − K) / (MAX − K) above the LayerNorm branch, the control 3e-7 (seed − 1) from it (a
    float32 rounding step of a loss near 5 is 4.8e-7)."""
    after = (step - k) / (MAX - k)
    kept = source_loss(seed, step) + (0.02 + 0.001 * seed) * (step > k)
    return kept + {"layernorm": 0.0, "rmsnorm_bias": (0.05 + 0.002 * seed) * after, "control": 3e-7 * (seed - 1)}[arm]


def write_metrics(run: Path, losses: dict[int, float]) -> None:
    """metrics.csv with a validation after each optimizer step of `losses` (logged at the step before)."""
    rows = [{"step": step - 1, "train/loss": loss + 0.1, "val/loss": loss} for step, loss in sorted(losses.items())]
    write_csv(run / "metrics.csv", rows, ["step", "train/loss", "val/loss"])


def write_angles(run: Path, seed: int, planted_at: set[int], steps: list[int]) -> None:
    """angles.csv as the real probe measures constructed inputs at `steps`: a component 0.25 * 1 at layer 1's
    attention norm at the steps of `planted_at`, none elsewhere."""
    rows = []
    for step in steps:
        inputs = seed_inputs(100 + seed, {PLANTED: 0.25} if step in planted_at else {})
        measured_table(run / f"step{step}.csv", inputs, step)
        rows += (run / f"step{step}.csv").read_text().splitlines()[1 if rows else 0:]
    (run / "angles.csv").write_text("\n".join(rows) + "\n")


def source(root: Path, seed: int) -> Path:
    run = make_run(root, f"tiny-layernorm-seed{seed}", "layernorm", seed, steps=MAX, max_steps=MAX)
    write_metrics(run, {s: source_loss(seed, s) for s in range(1, MAX + 1)})
    return run


def branch(root: Path, arm: str, seed: int, source_dir: Path, k: int, angles: bool = False) -> Path:
    norm, control = ARMS[arm]
    run = make_run(root, f"k{k}/{arm}-{source_dir.parent.name}-seed{seed}", norm, seed, steps=MAX, max_steps=MAX,
                   settings={"branch.source": str(source_dir), "branch.step": k, "branch.zero_mean_writers": control})
    write_metrics(run, {s: branch_loss(arm, seed, s, k) for s in range(k, MAX + 1)})
    if angles:
        write_angles(run, seed, {MAX} if arm == "rmsnorm_bias" else set(), [k, MAX])
    return run


def study(root: Path, steps=(4,), angles: bool = False) -> Path:
    """Three LayerNorm sources (seeds 0-2) and their three arms at each K of `steps`."""
    for seed in SEEDS:
        found = source(root / "norm_arms", seed)
        for k in steps:
            for arm in ARMS:
                branch(root / "branch", arm, seed, found, k, angles)
    return root / "branch"


@pytest.fixture(scope="module")
def reported(tmp_path_factory) -> Path:
    """The report of a study with K = 4 and 6, its branches' angles planted, written once for the tests below."""
    root = tmp_path_factory.mktemp("branches")
    report(f"runs={study(root, steps=(4, 6), angles=True)}", f"out={root / 'out'}", figures=True)
    return root


def comparison(groups, role: str):
    return next(c for g in groups for c in g.comparisons if c.role == role or (not role and c.centring))


def test_branches_are_paired_by_source_and_seed_with_their_source_continuing(tmp_path):
    branches = study(tmp_path)
    rerun = source(tmp_path / "rerun", 0)  # a second source of seed 0: its branches pair among themselves
    for arm in ARMS:
        branch(tmp_path / "branch", arm, 0, rerun, 4)

    (group,) = group_runs(find_runs([branches])[0])  # the sources read from branch.source, not given

    assert group.branch_step == 4 and not [r.name for r in group.runs if r.left_out]
    converted, control, restart = (comparison([group], role) for role in ("", "control", "restart"))
    assert converted.label == "rmsnorm_bias − layernorm (with bias)" and converted.centring
    assert control.other == "rmsnorm_bias (zero-mean writers)" and control.base == "layernorm" and not control.centring
    assert restart.other == "layernorm" and restart.base == "layernorm (source, continuing)"
    for c in (converted, control, restart):  # 4 pairs: seed 0 twice, by its two sources
        assert sorted(base.seed for base, _ in c.pairs) == [0, 0, 1, 2]
        assert all(b.branch_source == o.branch_source or b.dir == o.branch_source for b, o in c.pairs)
    assert sorted(converted.differences) == pytest.approx([0.05, 0.05, 0.052, 0.054])
    assert sorted(restart.differences) == pytest.approx([0.02, 0.02, 0.021, 0.022])
    assert max(map(abs, control.differences)) == pytest.approx(3e-7)


def test_each_k_is_a_group_in_one_holm_family_and_the_report_gives_every_step_from_k(reported):
    groups = group_runs(find_runs([reported / "branch"])[0])
    assert [g.branch_step for g in groups] == [4, 6]
    plain = [c.interval for g in groups for c in group_family(g, primary_of(g))]
    members = family(groups)
    assert [m.interval.holm_p for m in members] == pytest.approx([i.holm_p for i in simultaneous(plain)])
    assert len(members) == 6 and sum(m.primary for m in members) == 2  # each K's uncentred − centred

    summary = (reported / "out/summary.md").read_text()
    assert "Primary contrast of tiny (branch.step=4" in summary and "Branches of steps 4, 6" in summary
    section = summary.split("### From step 4: paired difference of validation loss at every validation")[1]
    rows = {int(m[1]): m[2] for m in re.finditer(r"^\| (\d) \| (.*) \|$", section.split("###")[0], re.M)}
    assert sorted(rows) == [4, 5, 6, 7, 8]
    converted_at = {step: cells.split(" | ")[0] for step, cells in rows.items()}
    assert converted_at[4].startswith("+0.0000 [+0.0000, +0.0000]")  # one function at K
    assert converted_at[6].startswith("+0.0260 [")  # (0.05 + 0.002 seed) / 2, over seeds 0-2
    # the control's final differences, 3e-7 (seed − 1): ±4.3027 x 3e-7 / sqrt(3), in digits that show it
    control = next(line for line in summary.splitlines()
                   if line.startswith("| tiny (branch.step=4) | control |"))
    assert control.split(" | ")[4] == "[-7.5e-07, +7.5e-07]"  # its 95% CI, in the verdict's table
    verdict_rows = [line for line in summary.splitlines() if line.startswith("| tiny (branch.step=")]
    # 3 comparisons and 4 arms a K, each row about 120 characters at most (a branch group's title is long)
    assert len(verdict_rows) == 2 * (3 + 4) and max(map(len, verdict_rows)) <= 125
    with open(reported / "out/verdict_comparisons.csv") as f:  # the CSV keeps what 4 decimals would round away
        (floor,) = [r for r in csv.DictReader(f) if "control" in r["label"] and "=4" in r["model"]]
    assert [float(v) for v in floor["per_seed"].split()] == pytest.approx([-3e-7, 0, 3e-7], abs=1e-12)
    with open(reported / "out/branch_losses.csv") as f:
        found = [r for r in csv.DictReader(f) if r["branch_step"] == "6" and r["step"] == "8"]
    assert len(found) == 3 and {r["seeds"] for r in found} == {"3"}
    restart = next(r for r in found if "source, continuing" in r["comparison"])
    assert float(restart["mean"]) == pytest.approx(0.021)
    # a figure per K, named by the setting that sets its group apart
    assert sorted(p.name for p in (reported / "out").glob("branch_*.png")) == [
        "branch_tiny-branch.step_4.png", "branch_tiny-branch.step_6.png"]


def test_the_converted_branch_growing_a_1_component_is_found_and_drawn(reported):
    with open(reported / "out/branch_shares.csv") as f:
        shares = {(r["arm"], int(r["step"])): r for r in csv.DictReader(f) if r["branch_step"] == "4"}
    grown = shares[("rmsnorm_bias", MAX)]
    assert grown["largest_site"] == "1 attn" and float(grown["p_max"]) == pytest.approx(0.01)  # beyond all 99
    assert float(shares[("rmsnorm_bias", 4)]["p_max"]) > 0.05 and float(shares[("layernorm", MAX)]["p_max"]) > 0.05
    summary = (reported / "out/summary.md").read_text()
    (grown_line,) = [line for line in summary.splitlines() if line.startswith("- rmsnorm_bias: ")][:1]
    assert re.fullmatch(r"- rmsnorm_bias: 0\.\d{4} at step 4, 0\.\d{4} at step 8 \(a random direction's median "
                        r"share: 0\.\d{4}\); its most extreme site above random directions' from step 8 on\.",
                        grown_line), grown_line
    assert re.search(r"^- layernorm: .*; never beyond random directions'\.$", summary, re.M)
    assert float(grown["mean_share"]) > float(shares[("rmsnorm_bias", 4)]["mean_share"])

    group = group_runs(find_runs([reported / "branch"])[0])[0]
    family([group])
    with plt.rc_context(STYLE):
        fig = branch_figure(group)
        losses, final = losses_figure(group), loss_differences_figure(group)  # three comparisons of long names
    for name, drawn in (("branch", fig), ("loss", losses), ("loss_difference", final)):
        assert_readable(name, drawn)
    loss, share = fig.axes[:2]
    assert len(loss.lines) == 4 and len(loss.collections) == 3  # three comparisons with bands, and 0
    (largest,) = [line for line in share.lines if line.get_label() == "rmsnorm_bias: the largest site"]
    assert max(largest.get_ydata()) == pytest.approx(float(grown["largest_share"]))
    plt.close(fig)


def test_a_branch_whose_source_is_gone_is_compared_without_it_and_says_so(tmp_path):
    branches = study(tmp_path)
    (tmp_path / "norm_arms/tiny-layernorm-seed2/metrics.csv").unlink()

    (group,) = group_runs(find_runs([branches])[0])

    restart = comparison([group], "restart")
    assert sorted(base.seed for base, _ in restart.pairs) == [0, 1]
    (note,) = {r.note for r in group.runs if r.note.startswith("its source")}
    assert "tiny-layernorm-seed2 is not there" in note
    assert len(comparison([group], "").pairs) == 3 and not math.isnan(comparison([group], "").interval.mean)


def test_a_branch_group_without_its_converted_arm_says_what_its_primary_contrast_needs(tmp_path):
    for seed in SEEDS:  # the LayerNorm branches and the control, but no converted branch finished
        found = source(tmp_path / "norm_arms", seed)
        for arm in ("layernorm", "control"):
            branch(tmp_path / "branch", arm, seed, found, 4)

    report(f"runs={tmp_path / 'branch'}", f"out={tmp_path / 'out'}")

    summary = (tmp_path / "out/summary.md").read_text()
    assert ("Primary contrast of tiny (analysis.primary=centring): not estimable here, as it needs an "
            "uncentred branch and the centred one of the same sources, finished.") in summary
    assert "2x2" not in summary.split("## Verdict")[1].split("The family")[0]
