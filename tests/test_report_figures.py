"""The report's figures read back from their matplotlib objects, on synthetic run directories with planted values
(test_report's helpers write them as normlab-train and normlab-ablate would): the axes a number is drawn on, the
points and bands against numbers computed by hand, the styles that tell norms and seeds apart, and the step in
every title. No training: each test takes seconds."""

import warnings
from dataclasses import replace
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgba

from conftest import compose_config
from normlab.probe.figure import angles_by_layer_figure
from normlab.study.report.contrasts import factorial, family, intervals_of
from normlab.study.report.figures import (
    BIGRAM_LABEL,
    STYLE,
    UNIGRAM_LABEL,
    ablation_figure,
    angles_training_figure,
    loss_differences_figure,
    losses_figure,
    references_figure,
)
from normlab.study.report.groups import Group, group_runs
from normlab.study.report.intervals import Interval
from normlab.study.report.runs import find_runs
from test_report import NEW_COLUMNS, angle_rows, make_run, user_norm_run, write_ablation, write_csv

FINAL_INPUT = 4  # the final norm's tick: after 0 attn, 0 MLP, 1 attn, 1 MLP (test_report's 2 layers)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def plant_losses(run_dir: Path, val: dict[int, float], train: float = 5.0) -> None:
    """metrics.csv of 10 optimizer steps: training loss `train` at every step, validation loss val[steps done]
    (logged, as Lightning does, at the index of the step before)."""
    rows = [{"step": s, "train/loss": train + s / 100} for s in range(10)]
    rows += [{"step": done - 1, "val/loss": loss} for done, loss in val.items()]
    write_csv(run_dir / "metrics.csv", rows, ["step", "train/loss", "val/loss"])


def plant_angles(run_dir: Path, final_angle: float, null_sd: float, steps=(0, 10)) -> None:
    """angles.csv with the null over random directions: every site at 90 degrees but the final norm's input."""
    rows = [r for step in steps for r in angle_rows(step, final_angle, 0.05, null_random_sd=null_sd)]
    write_csv(run_dir / "angles.csv", rows, NEW_COLUMNS)


def conf_style(norm: str) -> dict:
    """The colour and marker that conf/norm/<norm>.yaml gives the norm."""
    return dict(compose_config("train", [f"norm={norm}"]).norm.style)


def group_of(root: Path, unigram_loss: float | None = None, bigram_loss: float | None = None) -> Group:
    """The one group of the runs under `root`, with the unigram and bigram losses given (not those of the prepared
    data that the runs' config names, which this machine may or may not hold)."""
    (group,) = group_runs(find_runs([root])[0])
    return replace(group, runs=tuple(replace(run, unigram_loss=unigram_loss, bigram_loss=bigram_loss)
                                     for run in group.runs))


def axis_titled(fig, start: str):
    """The panel whose title begins so (as it reads: its lines are wrapped to the panel's width)."""
    (ax,) = [ax for ax in fig.axes if one_line(ax.get_title()).startswith(one_line(start))]
    return ax


def line_labelled(ax, label: str):
    (line,) = [line for line in ax.get_lines() if line.get_label() == label]
    return line


def bands(ax) -> list[PolyCollection]:
    return [c for c in ax.collections if isinstance(c, PolyCollection)]


def errorbar_labelled(ax, label: str):
    (container,) = [c for c in ax.containers if c.get_label() == label]
    return container


def one_line(text: str) -> str:
    """A label as it reads, without the breaks that fit it to its panel."""
    return " ".join(text.split())


def null_bands_of(ax) -> list[PolyCollection]:
    return [band for band in bands(ax) if band.get_label().startswith("null")]


VAL = {("layernorm", 0): {5: 3.60, 10: 3.00}, ("rmsnorm", 0): {5: 3.65, 10: 3.02},  # differences 0.05, 0.02
       ("layernorm", 1): {5: 3.70, 10: 3.10}, ("rmsnorm", 1): {5: 3.71, 10: 3.13}}  # and 0.01, 0.03


def test_the_loss_figure_gives_validation_its_own_axis_and_the_paired_difference_with_its_t_band(tmp_path):
    for (norm, seed), val in VAL.items():
        plant_losses(make_run(tmp_path, f"{norm}-seed{seed}", norm, seed), val)

    fig = losses_figure(group_of(tmp_path))

    train, val = axis_titled(fig, "training loss"), axis_titled(fig, "validation loss")
    low, high = val.get_ylim()
    assert 2.9 < low < 3.0 and 3.71 < high < 3.8  # the validation losses, not the training ones (5.0 .. 5.09)
    assert train.get_ylim()[0] > 4.9 and not val.get_shared_y_axes().joined(train, val)
    difference = axis_titled(fig, "rmsnorm − layernorm (the bias differs too)\n")
    for seed, planted in ((0, [0.05, 0.02]), (1, [0.01, 0.03])):
        line = line_labelled(difference, f"seed {seed}")
        assert list(line.get_xdata()) == [5, 10] and list(line.get_ydata()) == pytest.approx(planted)
    assert line_labelled(difference, "mean over 2 seeds").get_ydata() == pytest.approx([0.03, 0.025])
    (band,) = bands(difference)
    assert band.get_label() == "t 95% interval over 2 seeds"
    corners = band.get_paths()[0].vertices
    for step, values in ((5, [0.05, 0.01]), (10, [0.02, 0.03])):
        interval = Interval.of(values)
        assert sorted({round(y, 9) for x, y in corners if x == step}) == pytest.approx([interval.low, interval.high])
    final = Interval.of([0.02, 0.03])  # 0.025 +- 12.7062 x 0.00707 / sqrt 2
    assert one_line(difference.get_title()).endswith(f"step 10: {final.text()}")
    assert final.text() == "+0.0250 [-0.0385, +0.0885]"
    # the bias differs too: the sign names the norms, not the centring
    assert "> 0: rmsnorm higher than layernorm" in one_line(difference.get_ylabel())
    assert "nats/token" in difference.get_ylabel() and "centr" not in difference.get_ylabel()
    assert "step 10" in one_line(fig.get_suptitle())


def test_one_pair_draws_no_band_and_says_so(tmp_path):
    for norm in ("layernorm", "rmsnorm"):
        plant_losses(make_run(tmp_path, norm, norm), VAL[(norm, 0)])

    fig = losses_figure(group_of(tmp_path))

    difference = axis_titled(fig, "rmsnorm − layernorm")
    assert bands(difference) == []
    assert line_labelled(difference, "the one pair: no interval").get_ydata() == pytest.approx([0.05, 0.02])
    assert "step 10: +0.0200 (1 pair: no interval)" in one_line(difference.get_title())


def test_a_2x2_sweep_gets_a_difference_panel_per_comparison_and_the_final_figure_names_its_step(tmp_path):
    for norm, loss in (("layernorm", 3.0), ("rmsnorm_bias", 3.03), ("layernorm_nobias", 3.02), ("rmsnorm", 3.01)):
        for seed in (0, 1):
            make_run(tmp_path, f"{norm}-seed{seed}", norm, seed, loss + seed / 10)
    group = group_of(tmp_path)

    losses, final = losses_figure(group), loss_differences_figure(group)

    for title in ("rmsnorm_bias − layernorm (with bias)\n", "rmsnorm − layernorm_nobias (without bias)\n"):
        ylabel = one_line(axis_titled(losses, title).get_ylabel())  # the bias is common: the centring alone differs
        assert ylabel.startswith("val loss, uncentred − centred,") and ylabel.endswith("> 0: uncentred higher)")
    (ax,) = final.axes
    assert "final validation loss (step 10), paired by seed" in one_line(final.get_suptitle())
    assert one_line(ax.get_ylabel()) == "final val loss, uncentred − centred (nats/token; > 0: uncentred higher)"
    means = [c.lines[0].get_ydata()[0] for c in ax.containers if c.get_label() == "mean, t 95% interval over 2 seeds"]
    assert means == pytest.approx([0.03, -0.01])  # with the bias 3.03 - 3.00 in both seeds, without 3.01 - 3.02


def test_the_final_differences_figure_draws_the_interval_its_table_prints(tmp_path):
    """A 2x2 of 3 seeds with noise: once the report has made its family, each simple centring effect's bar is the
    factorial's pooled interval (6 df), as the comparison table prints it, not the pair's own paired t (2 df)."""
    noise = {("layernorm", 0): 0.004, ("rmsnorm_bias", 1): -0.006, ("layernorm_nobias", 2): 0.005,
             ("rmsnorm", 0): -0.003}
    for norm, loss in (("layernorm", 3.0), ("rmsnorm_bias", 3.03), ("layernorm_nobias", 3.02), ("rmsnorm", 3.01)):
        for seed in range(3):
            make_run(tmp_path, f"{norm}-seed{seed}", norm, seed, loss + seed / 10 + noise.get((norm, seed), 0.0))
    group = group_of(tmp_path)
    paired = {(c.interval.low, c.interval.high) for c in group.comparisons}
    members = family([group])  # as normlab-report does before its tables and figures, which it hands them
    (ax,) = loss_differences_figure(group, intervals_of(members, group)).axes
    bars = [c.lines[2][0].get_segments()[0] for c in ax.containers if c.get_label().startswith("mean, t 95%")]
    effects = factorial(group)
    assert not {(low, high) for (_, low), (_, high) in bars} & paired
    expected = [effects[f"centring {bias} bias"].interval for bias in ("with", "without")]
    assert [end for (_, low), (_, high) in bars for end in (low, high)] == pytest.approx(
        [end for i in expected for end in (i.low, i.high)])
    assert {i.df for i in expected} == {6}


def test_the_final_differences_figure_says_its_final_loss_is_a_mean_of_validations(tmp_path):
    for norm, loss in (("layernorm", 3.0), ("rmsnorm", 3.01)):
        for seed in (0, 1):
            make_run(tmp_path, f"{norm}-seed{seed}", norm, seed, loss, settings={"analysis.final_validations": 2})
    final = loss_differences_figure(group_of(tmp_path))
    title = one_line(final.get_suptitle())
    assert "final validation loss (the mean of 2 validations, steps 5-10), paired by seed" in title


DYT_VAL = {("layernorm", 0): {5: 3.60, 10: 3.00}, ("rmsnorm", 0): {5: 3.65, 10: 3.02},
           ("dyt", 0): {5: 4.90, 10: 4.25},  # dyt − layernorm 1.30, 1.25: far above the norms that normalize
           ("layernorm", 1): {5: 3.70, 10: 3.10}, ("rmsnorm", 1): {5: 3.71, 10: 3.13},
           ("dyt", 1): {5: 4.75, 10: 4.30}}  # and 1.05, 1.20


def test_dyt_is_drawn_in_its_colour_with_its_losses_and_differences_on_axes_of_their_own(tmp_path):
    """DyT's losses, far above, would squash those of the norms that normalize on one y axis: a point-wise layer
    (by its traits, not its name) gets its own validation panel and its own axis of final differences."""
    for (norm, seed), val in DYT_VAL.items():
        run = make_run(tmp_path, f"{norm}-seed{seed}", norm, seed)
        plant_losses(run, val)
        plant_angles(run, 92.0 + seed if norm == "dyt" else 90.0, 0.5)
    write_ablation(tmp_path / "dyt-seed0", 0.2, 0.15, 0.25)
    group = group_of(tmp_path)

    losses, final = losses_figure(group), loss_differences_figure(group)
    angles, ablation = angles_by_layer_figure(group.title, group.series()), ablation_figure(group.title, group.series())

    dyt_color = to_rgba(conf_style("dyt")["color"])
    normalizing = axis_titled(losses, "validation loss:\nnormalizing norms")
    pointwise = axis_titled(losses, "validation loss:\npoint-wise layers")
    assert normalizing.get_ylim()[1] < min(DYT_VAL[("dyt", 0)].values())  # DyT's losses lie above its range
    assert not [line for line in normalizing.get_lines() if line.get_label().lstrip("_").startswith("dyt")]
    assert line_labelled(normalizing, "_rmsnorm seed 1").get_ydata() == pytest.approx([3.71, 3.13])
    for seed in (0, 1):
        line = line_labelled(pointwise, f"_dyt seed {seed}")
        assert to_rgba(line.get_color()) == dyt_color
        assert list(line.get_ydata()) == pytest.approx(list(DYT_VAL[("dyt", seed)].values()))
    difference = axis_titled(losses, "dyt − layernorm\n(a point-wise layer in place of layernorm)\n")
    for seed, planted in ((0, [1.30, 1.25]), (1, [1.05, 1.20])):
        line = line_labelled(difference, f"seed {seed}")
        assert list(line.get_xdata()) == [5, 10] and list(line.get_ydata()) == pytest.approx(planted)
    assert line_labelled(difference, "mean over 2 seeds").get_ydata() == pytest.approx([1.175, 1.225])
    assert one_line(difference.get_title()).endswith(f"step 10: {Interval.of([1.25, 1.20]).text()}")
    assert one_line(difference.get_ylabel()) == ("val loss, dyt − layernorm, paired by seed "
                                                 "(nats/token; > 0: dyt higher than layernorm)")
    normalizing, pointwise = axis_titled(final, "between normalizing norms"), axis_titled(final, "with a point-wise")
    means = [c.lines[0].get_ydata()[0] for ax in (normalizing, pointwise) for c in ax.containers
             if c.get_label() == "mean, t 95% interval over 2 seeds"]
    assert means == pytest.approx([0.025, 1.225])  # rmsnorm − layernorm: 0.02, 0.03; dyt − layernorm: 1.25, 1.20
    (seeds,) = [list(line.get_ydata()) for line in pointwise.get_lines() if line.get_label().startswith("one seed")]
    assert seeds == pytest.approx([1.25, 1.20])
    assert pointwise.get_xticklabels()[0].get_text() == "dyt − layernorm\n(a point-wise layer in place\nof layernorm)"
    assert "> 0: rmsnorm higher than layernorm" in one_line(normalizing.get_ylabel())
    assert "> 0: dyt higher than layernorm" in one_line(pointwise.get_ylabel())
    mean = errorbar_labelled(axis_titled(angles, "angle to 1 at the norm inputs"),
                             "dyt: mean of 2 runs, bars ± std over tokens").lines[0]
    assert mean.get_ydata()[FINAL_INPUT] == pytest.approx(92.5) and to_rgba(mean.get_color()) == dyt_color
    assert mean.get_marker() == conf_style("dyt")["marker"]
    (ax,) = ablation.axes
    assert errorbar_labelled(ax, "_dyt seed 0 centred").lines[0].get_ydata() == pytest.approx([0.1, 0.2])
    assert one_line(ax.get_title()) == "dyt: centred (its input, before its point-wise map)"


def test_the_loss_legend_names_each_norm_and_each_seed_once_and_a_run_left_out_by_name(tmp_path):
    """Colour x style instead of a line per run: 2 norms and 3 seeds give 5 entries, not 6 (30 for the study's 5
    norms of 6 seeds); each seed's entry is drawn as its runs and its paired differences are."""
    for (norm, seed), val in VAL.items():
        plant_losses(make_run(tmp_path, f"{norm}-seed{seed}", norm, seed), val)
    for norm in ("layernorm", "rmsnorm"):
        plant_losses(make_run(tmp_path, f"{norm}-seed2", norm, 2), {5: 3.5, 10: 3.0})
    make_run(tmp_path, "rmsnorm-seed2-again", "rmsnorm", 2, loss=2.9)  # a replicate: left out

    fig = losses_figure(group_of(tmp_path))

    (legend,) = fig.legends
    entries = dict(zip([one_line(t.get_text()) for t in legend.get_texts()], legend.legend_handles))
    assert list(entries)[:6] == ["layernorm", "rmsnorm", "seed 0", "seed 1", "seed 2", "rmsnorm seed 2 (left out)"]
    assert not [label for label in entries if label.startswith("layernorm seed") or "its pair" in label]
    validation, difference = axis_titled(fig, "validation loss"), axis_titled(fig, "rmsnorm − layernorm")
    for seed in (0, 1, 2):
        handle, run = entries[f"seed {seed}"], line_labelled(validation, f"_rmsnorm seed {seed}")
        paired = line_labelled(difference, f"seed {seed}")
        assert handle.get_linestyle() == run.get_linestyle() == paired.get_linestyle()
        assert handle.get_marker() == run.get_marker() == paired.get_marker()
        assert to_rgba(handle.get_color()) == to_rgba(paired.get_color()) != to_rgba(run.get_color())
    assert to_rgba(entries["rmsnorm"].get_color()) == to_rgba(run.get_color())
    assert len({entries[f"seed {seed}"].get_linestyle() for seed in (0, 1, 2)}) == 3


def test_the_loss_curves_draw_the_unigram_and_bigram_losses_where_they_are_known(tmp_path):
    for (norm, seed), val in DYT_VAL.items():
        plant_losses(make_run(tmp_path, f"{norm}-seed{seed}", norm, seed), val)
    panels = ("training loss", "validation loss:\nnormalizing norms", "validation loss:\npoint-wise layers")

    known, unknown = losses_figure(group_of(tmp_path, 5.5, 4.6)), losses_figure(group_of(tmp_path, None))

    for title in panels:
        for label, bar in ((UNIGRAM_LABEL, 5.5), (BIGRAM_LABEL, 4.6)):
            line = line_labelled(axis_titled(known, title), label)
            assert list(line.get_ydata()) == [bar, bar] and list(line.get_xdata()) == [0, 1]  # across the panel
    legend = [one_line(text.get_text()) for text in known.legends[0].get_texts()]
    assert UNIGRAM_LABEL in legend and BIGRAM_LABEL in legend
    assert not [line for ax in unknown.axes for line in ax.get_lines()
                if line.get_label() in (UNIGRAM_LABEL, BIGRAM_LABEL)]


def plant_seeds(root: Path, angles: dict[str, list[float]], null_sd: dict[str, float]) -> Group:
    for norm, per_seed in angles.items():
        for seed, angle in enumerate(per_seed):
            plant_angles(make_run(root, f"{norm}-seed{seed}", norm, seed), angle, null_sd[norm])
    return group_of(root)


def test_angles_by_layer_shows_each_seeds_mean_and_one_null_band_for_norms_whose_nulls_coincide(tmp_path):
    group = plant_seeds(tmp_path, {"layernorm": [90.5, 91.5], "rmsnorm": [92.0, 94.7]},
                        {"layernorm": 0.4, "rmsnorm": 0.42})  # edges 0.02 apart: within NULL_MATCH of a sd

    fig = angles_by_layer_figure(group.title, group.series())

    inputs = axis_titled(fig, "angle to 1 at the norm inputs")
    for norm, planted in (("layernorm", [90.5, 91.5]), ("rmsnorm", [92.0, 94.7])):
        runs = line_labelled(inputs, f"{norm}: each run's (seed's) mean")
        at_final = [y for x, y in zip(runs.get_xdata(), runs.get_ydata()) if abs(x - FINAL_INPUT) < 0.5]
        assert sorted(at_final) == pytest.approx(planted)
        mean = errorbar_labelled(inputs, f"{norm}: mean of 2 runs, bars ± std over tokens").lines[0]
        assert mean.get_ydata()[FINAL_INPUT] == pytest.approx(sum(planted) / 2)
    for ax in fig.axes:
        (band,) = null_bands_of(ax)  # one band, not one per norm overlapping into a pattern
        assert band.get_label() == "null of every norm: mean angle to random directions ± 1 sd (for the runs' mean)"
        assert band.get_hatch() is None and band.get_facecolor()[0][3] <= 0.15  # unhatched, light
        assert sorted({round(y, 9) for _, y in band.get_paths()[0].vertices}) == pytest.approx([89.58, 90.42])
    assert "bars ± std over tokens" in one_line(inputs.get_ylabel())
    assert one_line(fig.get_suptitle()).endswith("step 10")


def test_a_norm_whose_null_differs_gets_a_band_of_its_own(tmp_path):
    """A point-wise layer that learned token frequencies only has a residual stream of nearly one vector, whose mean
    angle to random directions spreads far wider: one band for the norms alike, one in DyT's colour for it."""
    group = plant_seeds(tmp_path, {"layernorm": [90.0], "rmsnorm": [90.0], "dyt": [97.0]},
                        {"layernorm": 0.4, "rmsnorm": 0.42, "dyt": 4.0})

    fig = angles_by_layer_figure(group.title, group.series())

    inputs = axis_titled(fig, "angle to 1 at the norm inputs")
    alike, dyt = null_bands_of(inputs)
    assert alike.get_label().startswith("null of layernorm, rmsnorm: mean angle to random directions ± 1 sd")
    assert to_rgba(alike.get_edgecolor()[0])[:3] == to_rgba("grey")[:3]
    assert dyt.get_label().startswith("null of dyt: ")
    assert to_rgba(dyt.get_edgecolor()[0])[:3] == to_rgba(conf_style("dyt")["color"])[:3]
    assert sorted({round(y, 9) for _, y in dyt.get_paths()[0].vertices}) == pytest.approx([86.0, 94.0])
    assert len(null_bands_of(axis_titled(angles_training_figure(group.title, group.series()), "final norm"))) == 2


def test_angles_by_layer_of_one_run_draws_no_seed_markers(tmp_path):
    plant_angles(make_run(tmp_path, "rms", "rmsnorm"), 93.0, 0.5, steps=(0, 120))
    group = group_of(tmp_path)

    fig = angles_by_layer_figure(group.title, group.series())

    inputs = axis_titled(fig, "angle to 1 at the norm inputs")
    assert [line for line in inputs.get_lines() if "each run" in line.get_label()] == []
    assert errorbar_labelled(inputs, "rmsnorm: mean of 1 run, bars ± std over tokens").lines[0].get_ydata()[
        FINAL_INPUT] == pytest.approx(93.0)
    assert one_line(fig.get_suptitle()).endswith("step 120")


def test_the_references_figure_says_what_it_shows_and_names_its_step(tmp_path):
    group = plant_seeds(tmp_path, {"layernorm": [90.5], "rmsnorm": [92.0]}, {"layernorm": 0.4, "rmsnorm": 0.5})

    fig = references_figure(group.title, group.series())

    labels = {label for ax in fig.axes for label in ax.get_legend_handles_labels()[1]}
    assert "uniform vector 1" in labels and "random direction a~ (length √d)" in labels
    assert any(label.startswith("random direction b~") and "an angle ignores length" in label for label in labels)
    assert not any("does not matter" in label for label in labels)
    assert one_line(fig.get_suptitle()).endswith("the angle to 1 beside two random directions, step 10")
    assert "steps 0, 10" in one_line(angles_training_figure(group.title, group.series()).get_suptitle())


def test_the_ablation_figure_tells_seeds_of_one_norm_apart_and_names_the_steps_ablated(tmp_path):
    for seed in (0, 1):
        make_run(tmp_path, f"ln-seed{seed}", "layernorm", seed)
        make_run(tmp_path, f"rms-seed{seed}", "rmsnorm", seed)
    write_ablation(tmp_path / "rms-seed0", 0.01, 0.008, 0.012)
    write_ablation(tmp_path / "rms-seed1", 0.03, 0.025, 0.035, step=8)
    group = group_of(tmp_path)

    fig = ablation_figure(group.title, group.series())

    (ax,) = fig.axes  # a panel per norm with ablation rows: the LN runs have none
    assert ax.get_title() == "rmsnorm: centred"
    seed0, seed1 = (errorbar_labelled(ax, f"_rmsnorm seed {seed} centred").lines[0] for seed in (0, 1))
    assert seed0.get_marker() != seed1.get_marker() and seed0.get_color() == seed1.get_color()
    assert list(seed1.get_ydata()) == pytest.approx([0.015, 0.03])  # the site (delta / 2) and all at once
    assert one_line(fig.get_suptitle()).endswith("checkpoints at steps 8, 10")
    (legend,) = fig.legends  # an entry per seed, with its marker, not one per run
    assert [t.get_text() for t in legend.get_texts()] == ["seed 0", "seed 1"]
    assert [h.get_marker() for h in legend.legend_handles] == [seed0.get_marker(), seed1.get_marker()]


def test_the_ablation_figure_gives_each_norm_a_panel_on_its_own_scale(tmp_path):
    """An RMS model's +0.1 beside an LN model's +0.002: each in a panel of its own, its y range its own."""
    for seed in (0, 1):
        for norm, delta in (("layernorm", 0.002), ("rmsnorm", 0.1)):
            make_run(tmp_path, f"{norm}-seed{seed}", norm, seed)
            write_ablation(tmp_path / f"{norm}-seed{seed}", delta, delta - 0.0005, delta + 0.0005)
    group = group_of(tmp_path)

    ln, rms = ablation_figure(group.title, group.series()).axes
    assert ln.get_title().startswith("layernorm:") and rms.get_title().startswith("rmsnorm:")
    assert ln.get_ylim()[1] < 0.01 < 0.1 < rms.get_ylim()[1]
    assert not any(t.get_text() for t in ln.get_xticklabels()) and rms.get_xticklabels()[-1].get_text() == "all"


def test_a_norm_keeps_its_colour_and_marker_in_every_figure_and_the_norms_of_a_figure_differ(tmp_path):
    """The built-in norms' styles are those of their conf/norm yaml; two norms of a user's, without a style, get a
    colour and marker from their names: the same in every figure and report, never another norm's of the figure."""
    assert {norm: conf_style(norm) for norm in ("layernorm", "rmsnorm", "layernorm_nobias", "rmsnorm_bias", "dyt")} == {
        "layernorm": {"color": "tab:blue", "marker": "o"}, "rmsnorm": {"color": "tab:red", "marker": "s"},
        "layernorm_nobias": {"color": "tab:purple", "marker": "^"},
        "rmsnorm_bias": {"color": "tab:orange", "marker": "D"}, "dyt": {"color": "tab:green", "marker": "v"}}
    users = ("scalenorm", "scalenorm_wide")
    drawn = []
    for report, norms in (("a", ("layernorm", *users)), ("b", ("rmsnorm", "dyt", *users))):
        for norm in norms:
            run = user_norm_run(tmp_path / report, norm, norm=norm) if norm in users else make_run(
                tmp_path / report, norm, norm)
            plant_angles(run, 91.0, 0.5)
        group = group_of(tmp_path / report)
        inputs = axis_titled(angles_by_layer_figure(group.title, group.series()), "angle to 1 at the norm inputs")
        styles = {}
        for norm in norms:
            line = errorbar_labelled(inputs, f"{norm}: mean of 1 run, bars ± std over tokens").lines[0]
            styles[norm] = (to_rgba(line.get_color()), line.get_marker())
        assert len({color for color, _ in styles.values()}) == len({marker for _, marker in styles.values()}) == len(
            norms)
        validation = {line.get_label(): line for ax in losses_figure(group).axes  # DyT's panel: its own
                      if one_line(ax.get_title()).startswith("validation loss") for line in ax.get_lines()}
        assert all(to_rgba(validation[f"_{norm} seed 0"].get_color()) == styles[norm][0] for norm in norms)
        drawn.append(styles)
    assert all(drawn[0][norm] == drawn[1][norm] for norm in users)
    assert drawn[0]["layernorm"] == (to_rgba("tab:blue"), "o") and drawn[1]["dyt"] == (to_rgba("tab:green"), "v")


def inside(extent, canvas) -> bool:
    """Whether a window extent lies within the canvas (to the pixel rounding of its edges)."""
    return (extent.x0 >= canvas.x0 - 0.5 and extent.y0 >= canvas.y0 - 0.5 and extent.x1 <= canvas.x1 + 0.5
            and extent.y1 <= canvas.y1 + 0.5)


def assert_readable(name: str, fig) -> None:
    """The layout applied, the legend and everything else inside the canvas, each panel's title no wider than the
    panel and its y label no taller."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "constrained_layout not applied": a label too tall for its panel
        fig.canvas.draw()
    (legend,) = fig.legends
    assert inside(legend.get_window_extent(), fig.bbox), name
    everything = fig.get_tightbbox(fig.canvas.get_renderer()).transformed(fig.dpi_scale_trans)
    assert inside(everything, fig.bbox), name  # titles, axis labels and ticks too
    for ax in [ax for ax in fig.axes if ax.get_visible()]:
        panel, title, label = ax.get_window_extent(), ax.title.get_window_extent(), ax.yaxis.label.get_window_extent()
        assert not ax.get_title() or panel.x0 - 1 <= title.x0 and title.x1 <= panel.x1 + 1, (name, ax.get_title())
        assert not ax.get_ylabel() or panel.y0 - 1 <= label.y0 and label.y1 <= panel.y1 + 1, (name, ax.get_ylabel())


def test_the_2x2s_final_differences_keep_their_title_inside_a_narrow_figure(tmp_path):
    """The 2x2 alone: two comparisons make a figure narrower than its title's line ("the mean of 2 validations, steps
    2,500-2,800", as cpu_study's); the title is wrapped to the canvas, not cut at both edges."""
    for k, norm in enumerate(("layernorm", "rmsnorm_bias", "layernorm_nobias", "rmsnorm")):
        for seed in (0, 1):
            run = make_run(tmp_path, f"{norm}-seed{seed}", norm, seed, max_steps=2800,
                           settings={"analysis.final_validations": 2})
            plant_losses(run, {2500: 3.6 + k / 10, 2800: 3.0 + k / 100 + seed / 50})
    group = group_of(tmp_path, unigram_loss=4.0)
    with plt.rc_context(STYLE):
        fig = loss_differences_figure(group)
    assert len(fig.get_suptitle().splitlines()) > 2  # the title's one line was wrapped
    assert_readable("loss_difference of the 2x2", fig)


def test_every_figure_keeps_its_legend_and_labels_inside_the_canvas(tmp_path):
    """Five norms of two seeds each, DyT's null apart: the longest legends the report draws for a 2x2 and DyT, in the
    report's style; the per-layer figure also in matplotlib's defaults, as training's angle callback draws it."""
    norms = ("layernorm", "rmsnorm_bias", "layernorm_nobias", "rmsnorm", "dyt")
    for k, norm in enumerate(norms):
        for seed in (0, 1):
            run = make_run(tmp_path, f"{norm}-seed{seed}", norm, seed)
            plant_losses(run, {5: 3.6 + k / 10, 10: 3.0 + k / 100 + seed / 50})
            plant_angles(run, 97.0 if norm == "dyt" else 90.0 + seed, 4.0 if norm == "dyt" else 0.5)
            write_ablation(run, 0.01 * (seed + 1), 0.0, 0.03)
    group = group_of(tmp_path, unigram_loss=4.0)
    series = group.series()

    with plt.rc_context(STYLE):
        figures = {"loss": losses_figure(group), "loss_difference": loss_differences_figure(group),
                   "angles_by_layer": angles_by_layer_figure(group.title, series),
                   "references": references_figure(group.title, series),
                   "angles_training": angles_training_figure(group.title, series),
                   "ablation": ablation_figure(group.title, series)}
    figures["angles_by_layer, matplotlib's defaults"] = angles_by_layer_figure(group.title, series)

    for name, fig in figures.items():
        assert_readable(name, fig)
    assert len(null_bands_of(axis_titled(figures["angles_by_layer"], "angle to 1 at the norm inputs"))) == 2
