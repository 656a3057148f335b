"""Real training runs of the tiny model through the real entry point (Hydra -> Lightning, CPU)."""

import csv
import math
import re
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from conftest import FAST_TRAIN, TAG, compose_config, run_cli, run_of
from normlab.common.errors import NonFiniteError
from normlab.data.corpus import load_probe
from normlab.data.tokenizer import EOT
from normlab.probe.table import read_csv
from normlab.training.module import lr_factor
from normlab.training.pipeline import build, build_module, build_run_directory, build_trainer
from normlab.training.rundir.checkpoints import verify
from test_report import per_seed_table

NORMS = ("layernorm", "rmsnorm")


def read_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    metrics: dict[str, dict[int, float]] = {}
    with open(run_dir / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value and key not in ("step", "epoch"):
                    assert int(row["step"]) not in metrics.get(key, {}), f"duplicate {key} at step {row['step']}"
                    metrics.setdefault(key, {})[int(row["step"])] = float(value)
    return metrics


@pytest.mark.parametrize("norm", NORMS)
def test_run_directory_holds_resolved_config_metrics_and_scheduled_checkpoints(sweep, norm):
    run = run_of(sweep, norm)
    config = OmegaConf.load(run / "config.yaml")
    assert config.norm.name == norm and config.run_dir == str(run)
    assert "${" not in (run / "config.yaml").read_text()  # resolved
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("*.ckpt"))
    assert ckpts == [
        "last.ckpt",
        "previous.ckpt",
        "step-0000000.ckpt",
        "step-0000002.ckpt",
        "step-0000004.ckpt",
        "step-0000006.ckpt",
    ]
    for name in ckpts:  # each with its digest
        record = verify(run / "checkpoints" / name)
        assert torch.load(run / "checkpoints" / name, weights_only=False)["global_step"] == record.step
    assert (
        verify(run / "checkpoints" / "last.ckpt").step == 6 and verify(run / "checkpoints" / "previous.ckpt").step == 4
    )
    assert re.fullmatch(r"[0-9a-f]{16}\n", (run / "run_id").read_text())  # its wandb id, drawn at random


def test_scheduled_checkpoints_hold_weights_and_last_the_full_state(sweep):
    """Scheduled checkpoints are 4 bytes per parameter (float32 weights), last.ckpt 12 (weights and AdamW's two
    moments): the sizes docs/run-directory.md's table gives for the paper runs."""
    run = run_of(sweep, "layernorm")
    params = 6_541_184  # the tiny model with 2 layers, LayerNorm
    weights = torch.load(run / "checkpoints" / "step-0000004.ckpt", weights_only=False)
    full = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert "optimizer_states" not in weights and {"state_dict", "hyper_parameters", "global_step"} <= weights.keys()
    assert len(full["optimizer_states"][0]["state"]) == len(list(full["state_dict"]))
    assert 4 * params < (run / "checkpoints" / "step-0000004.ckpt").stat().st_size < 4 * params * 1.01
    assert 12 * params < (run / "checkpoints" / "last.ckpt").stat().st_size < 12 * params * 1.01


def test_every_job_of_a_sweep_has_its_own_directory_and_wandb_id(sweep):
    runs = sorted(p for p in sweep.iterdir() if (p / "metrics.csv").is_file())
    assert [p.name for p in runs] == [f"tiny-{n}-seed{s}{TAG}" for n in NORMS for s in (0, 1)]
    assert len({(p / "run_id").read_text() for p in runs}) == 4


@pytest.mark.parametrize("norm", NORMS)
def test_metrics_csv_has_loss_lr_and_tokens_per_second_at_every_step(sweep, norm):
    run = run_of(sweep, norm)
    metrics = read_metrics(run)
    steps = set(range(6))
    assert set(metrics["train/loss"]) == steps
    assert abs(metrics["train/loss"][0] - math.log(50257)) < 0.2  # untrained: uniform over the vocabulary
    assert set(metrics["train/tokens_per_sec"]) == steps and min(metrics["train/tokens_per_sec"].values()) > 0
    assert set(metrics["val/loss"]) == {1, 3, 5}  # every trainer.val_check_interval=2 steps, the last one included
    peak, warmup = 3e-3, 1  # tiny preset lr; 1% of 6 steps rounds up to one warm-up step
    for step, lr in metrics["lr-AdamW/pg1"].items():
        assert lr == pytest.approx(peak * lr_factor(step, warmup, 6, 0.1))


@pytest.mark.parametrize("norm", NORMS)
def test_angles_csv_holds_every_layer_site_and_reference_at_step_0_and_every_checkpoint(sweep, prepared, norm):
    run = run_of(sweep, norm)
    rows = read_csv(run / "angles.csv")
    assert sorted({r["step"] for r in rows}) == [0, 2, 4, 6]  # the checkpoint schedule
    at_0 = [r for r in rows if r["step"] == 0]
    assert {(r["layer"], r["site"]) for r in at_0} == {
        (layer, f"{role}.{io}")
        for layer in range(2)
        for role in ("attn_norm", "mlp_norm")
        for io in ("input", "output", "rotation")
    } | {(2, "final_norm.input"), (2, "final_norm.output"), (2, "final_norm.rotation")}
    probe = load_probe(str(prepared), "val", 4096, 128)  # FAST_TRAIN's probe.tokens of the held-out split, in windows
    starts = int((probe[:, :-1] == EOT).sum())  # documents that begin inside a window (the second one, at 2538)
    assert starts and {r["count"] for r in at_0 if r["position"] == "all"} == {probe.numel()}
    assert {r["count"] for r in at_0 if r["position"] == "first"} == {starts}
    assert {r["count"] for r in at_0 if r["position"] == "rest"} == {probe.numel() - starts}
    ln_out = [r for r in at_0 if r["site"] == "attn_norm.output" and r["reference"] == "uniform"]
    if norm == "layernorm":  # at step 0 gamma = 1, beta = 0: LN's output is orthogonal to 1 by construction
        assert all(abs(r["mean_deg"] - 90) < 1e-3 and r["std_deg"] < 1e-3 for r in ln_out)
    assert all(r["null_std_deg"] == pytest.approx(math.degrees(1 / 8)) for r in rows)  # d = 64
    config = OmegaConf.load(run / "config.yaml")
    assert {(r["run"], r["model"], r["norm"], r["seed"], r["source"]) for r in rows} == {
        (run.name, "tiny", norm, "0", "training")}
    angles = [r for r in rows if not r["site"].endswith(".rotation")]
    assert {r["null_directions"] for r in angles} == {config.probe.null_directions}  # 8 random directions
    assert all(0 <= r["null_percentile"] <= 100 and r["null_random_std_deg"] > 0 for r in angles)


def test_a_final_step_off_the_schedule_gets_its_checkpoint_and_angles_and_an_older_finished_run_is_left_alone(
    prepared, tmp_path
):
    """trainer.max_steps=6 with scheduled checkpoints every 4 steps: 0, 4 and 6, the final weights measured too, so
    that the run's last loss and last angles are of one step. A run written before the final step was scheduled
    (no step-6 checkpoint, no step-6 angle rows) is finished: requeued, it does nothing, tries to measure nothing."""
    overrides = [*FAST_TRAIN, "checkpoints.every=4",
                 "checkpoints.sparse_every=100", f"run_dir={tmp_path}"]
    result = run_cli("normlab-train", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*.ckpt")) == [
        "step-0000000.ckpt", "step-0000004.ckpt", "step-0000006.ckpt"]
    assert verify(checkpoints / "step-0000006.ckpt").step == verify(checkpoints / "last.ckpt").step == 6
    final = torch.load(checkpoints / "step-0000006.ckpt", weights_only=False)["state_dict"]
    last = torch.load(checkpoints / "last.ckpt", weights_only=False)["state_dict"]
    assert all(torch.equal(final[k], last[k]) for k in last)  # the weights the run ends with
    rows = read_csv(tmp_path / "angles.csv")
    by_step = {s: [r for r in rows if r["step"] == s] for s in (0, 4, 6)}
    assert sorted({r["step"] for r in rows}) == [0, 4, 6]
    assert len(by_step[6]) == len(by_step[4]) == len(by_step[0])
    assert [r["mean_deg"] for r in by_step[6]] != [r["mean_deg"] for r in by_step[4]]  # two more steps of training

    (checkpoints / "step-0000006.ckpt").unlink()  # as a run trained before the final step was scheduled
    (checkpoints / "step-0000006.ckpt.json").unlink()
    header, *lines = (tmp_path / "angles.csv").read_text().splitlines()
    step = header.split(",").index("step")
    (tmp_path / "angles.csv").write_text("\n".join([header, *(x for x in lines if x.split(",")[step] != "6")]) + "\n")
    before = snapshot(tmp_path)
    again = run_cli("normlab-train", *overrides)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{tmp_path} is finished (step 6 of 6): nothing to do" in again.stdout
    assert "angles.csv" not in again.stderr  # no attempt to measure a step whose checkpoint never existed
    assert {p: b for p, b in snapshot(tmp_path).items() if not p.name.endswith(".yaml")} == {
        p: b for p, b in before.items() if not p.name.endswith(".yaml")}


def test_lr_schedule_warms_up_linearly_then_decays_to_ten_percent():
    assert [lr_factor(s, 4, 100, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, 4, 100, 0.1) == 1.0
    assert lr_factor(52, 4, 100, 0.1) == pytest.approx(0.55)  # half-way through the cosine
    assert lr_factor(100, 4, 100, 0.1) == pytest.approx(0.1)
    values = [lr_factor(s, 4, 100, 0.1) for s in range(4, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("norm", NORMS)
def test_step_zero_checkpoint_holds_the_initial_weights(sweep, norm):
    run = run_of(sweep, norm)
    initial = build_module(OmegaConf.load(run / "config.yaml")).state_dict()
    step0 = torch.load(run / "checkpoints" / "step-0000000.ckpt", weights_only=False)["state_dict"]
    step6 = torch.load(run / "checkpoints" / "step-0000006.ckpt", weights_only=False)["state_dict"]
    assert step0.keys() == initial.keys()
    assert all(torch.equal(step0[k], initial[k]) for k in initial)
    assert not torch.equal(step6["model.wte.weight"], initial["model.wte.weight"])


def test_ln_and_rms_runs_differ_only_in_norm_parameters(sweep):
    ln = torch.load(run_of(sweep, "layernorm") / "checkpoints/step-0000000.ckpt", weights_only=False)["state_dict"]
    rms = torch.load(run_of(sweep, "rmsnorm") / "checkpoints/step-0000000.ckpt", weights_only=False)["state_dict"]
    assert rms.keys() <= ln.keys()
    assert all(torch.equal(ln[k], rms[k]) for k in rms)


def snapshot(directory: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_rerunning_the_same_command_resumes_and_a_changed_config_is_refused(sweep, tmp_path):
    run = Path(shutil.copytree(run_of(sweep, "layernorm"), tmp_path / "run"))  # a moved run keeps its identity
    before = snapshot(run)
    finished = run_cli("normlab-train", "norm=layernorm", f"run_dir={run}", *FAST_TRAIN)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert f"{run} is finished (step 6 of 6): nothing to do" in finished.stdout
    after = snapshot(run)
    assert OmegaConf.load(run / "config.yaml").run_dir == str(run)  # the config follows the moved directory
    assert {p: b for p, b in after.items() if not p.name.endswith(".yaml")} == {
        p: b for p, b in before.items() if not p.name.endswith(".yaml")
    }  # nothing else appended, nothing lost
    before = after

    changed = run_cli("normlab-train", "norm=layernorm", f"run_dir={run}", *FAST_TRAIN, "trainer.max_steps=8")
    assert changed.returncode == 2
    (line,) = changed.stderr.strip().splitlines()
    assert "holds checkpoints of another config (trainer.max_steps: 6 -> 8" in line and "restart=true" in line
    assert snapshot(run) == before  # nothing on disk changed

    restarted = run_cli(
        "normlab-train", "norm=layernorm", f"run_dir={run}", *FAST_TRAIN, "trainer.max_steps=8", "restart=true"
    )
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert set(read_metrics(run)["train/loss"]) == set(range(8))
    (aside,) = tmp_path.glob("run.replaced-*")
    assert snapshot(aside) == {aside / p.relative_to(run): data for p, data in before.items()}  # moved, not deleted
    assert (run / "run_id").read_text() != (aside / "run_id").read_text()  # a new wandb run


def test_wandb_logs_offline_without_an_account(prepared, tmp_path):
    overrides = [o for o in FAST_TRAIN if not o.startswith("logger=")] + ["trainer.max_steps=2"]
    result = run_cli(
        "normlab-train",
        f"run_dir={tmp_path}",
        *overrides,
        env={"WANDB_MODE": None, "WANDB_API_KEY": None, "WANDB_DIR": None},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (offline,) = (tmp_path / "wandb").glob("offline-run-*")
    assert offline.name.endswith((tmp_path / "run_id").read_text().strip())  # the run's own id
    assert OmegaConf.load(tmp_path / "config.yaml").logger.wandb.id == (tmp_path / "run_id").read_text().strip()
    assert (tmp_path / "metrics.csv").is_file()


def test_a_job_log_shows_progress_lines_and_no_library_noise(prepared, tmp_path):
    """Output not on a terminal (a Slurm job's log): no progress bar, a line every print_every steps instead, and
    Lightning's and wandb's messages reduced to what a user reads (the wandb logger on, offline)."""
    overrides = [o for o in FAST_TRAIN if not o.startswith("logger=")]
    overrides += ["callbacks.throughput.print_every=4", "callbacks.throughput.print_every_seconds=null"]
    result = run_cli("normlab-train", f"run_dir={tmp_path}", *overrides, fresh=True)  # all it prints, imports too
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    with open(tmp_path / "metrics.csv", newline="") as f:
        losses = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r["train/loss"]}
    lines = [line for line in log.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 4/6 (67%)", "step 6/6 (100%)"]
    pattern = (r"step (\d)/6 \(\d+%\) \| loss ([\d.]+) \| lr ([\d.e-]+) \| [\d,]+ tokens/s \| "
               r"elapsed [\d:]+ \| ETA ([\d:]+)")
    for line, step in zip(lines, (4, 6)):
        shown_step, loss, lr, eta = re.fullmatch(pattern, line).groups()
        assert int(shown_step) == step and float(loss) == pytest.approx(losses[step - 1], abs=1e-4)  # just taken
    assert eta == "0:00:00"
    assert "6,541,184 parameters (2 layers, d=64, layernorm)" in log  # the one-line summary, not Lightning's table
    for noise in ("Tip:", "TPU available", "Total FLOPs", "Epoch 0/", "Run history", "Run summary", "LeafSpec"):
        assert noise not in log, noise
    assert log.count("`Trainer.fit` stopped") == 1  # once, not once per console


def test_a_job_log_gets_a_line_every_m_seconds_when_that_comes_before_every_n_steps(prepared, tmp_path):
    """A slow run's log keeps moving: with print_every_seconds=0 every step's line is due before print_every's."""
    overrides = [*FAST_TRAIN, "callbacks.throughput.print_every=1000", "callbacks.throughput.print_every_seconds=0"]
    result = run_cli("normlab-train", f"run_dir={tmp_path}", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split(" | ")[0] for line in result.stdout.splitlines() if line.startswith("step ")]
    assert lines == [f"step {s}/6 ({s / 6:.0%})" for s in range(1, 7)]


def test_a_terminal_shows_a_bar_titled_by_training_steps(prepared, tmp_path):
    """On a terminal, Lightning's bar instead of the progress lines, counting the run's steps; not "Epoch 0/-2"."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import termios

    from conftest import BIN

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a terminal 160 columns wide
    process = subprocess.Popen([str(BIN / "normlab-train"), f"run_dir={tmp_path}", *FAST_TRAIN],
                               stdout=follower, stderr=follower, env={**os.environ, "WANDB_MODE": "offline"})
    os.close(follower)
    shown = b""
    while chunk := _read_or_end(leader):
        shown += chunk
    assert process.wait(timeout=300) == 0, shown.decode()[-3000:]
    screen = shown.decode(errors="replace").replace("\r", "\n")
    assert re.search(r"^Training: 100%.*\| 6/6 ", screen, re.M), screen[-3000:]
    assert "Epoch 0/" not in screen and "step 6/6 (100%)" not in screen  # no epoch count, no progress lines


def _read_or_end(fd: int) -> bytes:
    import os

    try:
        return os.read(fd, 65536)
    except OSError:  # the pty's other end closed: the process ended
        return b""


def test_report_draws_the_loss_curves_and_summarises_both_norms(sweep, tmp_path):
    result = run_cli("normlab-report", f"runs={sweep}", f"out={tmp_path}", "learning_check=false")  # 6 steps
    assert result.returncode == 0, result.stderr
    summary = (tmp_path / "summary.md").read_text()
    for norm in NORMS:
        for seed in (0, 1):
            assert f"| tiny-{norm}-seed{seed}{TAG} | {norm} | {seed} |" in summary
    assert "| 6,541,184 |" in summary and "| 6,540,864 |" in summary  # LN has (2L+1) d = 5 x 64 more
    for figure in ("loss_tiny", "loss_difference_tiny", "angles_by_layer_tiny", "references_tiny",
                   "angles_training_tiny"):
        assert (tmp_path / f"{figure}.png").stat().st_size > 10_000 and f"({figure}.png)" in summary
        assert (tmp_path / f"{figure}.pdf").is_file()
    assert "Angle to 1 at the norm inputs, per layer" in summary
    assert list(per_seed_table(summary)) == ["rmsnorm − layernorm (the bias differs too)"]  # by seed, 2 seeds
    assert len(per_seed_table(summary)["rmsnorm − layernorm (the bias differs too)"]) == 3  # and their mean
    assert "| tiny | rmsnorm | 2 | 6 |" in summary and "| tiny | rmsnorm − layernorm | 2 | " in summary  # the verdict


def test_sweep_ran_every_norm_and_seed_with_its_own_initialisation(sweep):
    seed0 = torch.load(run_of(sweep, "layernorm") / "checkpoints/step-0000000.ckpt", weights_only=False)["state_dict"]
    seed1 = torch.load(run_of(sweep, "layernorm", 1) / "checkpoints/step-0000000.ckpt", weights_only=False)[
        "state_dict"
    ]
    assert not torch.equal(seed0["model.wte.weight"], seed1["model.wte.weight"])


def test_non_finite_loss_stops_the_run_with_a_diagnostic_checkpoint(prepared, tmp_path):
    result = run_cli("normlab-train", *FAST_TRAIN, f"run_dir={tmp_path}", "optimizer.lr=1e30", "trainer.max_steps=30")
    assert result.returncode == 2
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("normlab-train: error: non-finite loss at optimizer step 1 (loss nan)")
    assert f"last intact checkpoint {tmp_path}/checkpoints/step-0000000.ckpt" in last_line
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt"))
    assert ckpts == ["nonfinite-step-0000001.ckpt", "step-0000000.ckpt"]
    diagnostic = torch.load(tmp_path / "checkpoints" / "nonfinite-step-0000001.ckpt", weights_only=False)
    assert diagnostic["global_step"] == 2  # found before the validation after step 2: step 2 was skipped too
    assert diagnostic["callbacks"]["NonFiniteGuard"] == {"first_nonfinite_step": 1}
    assert all(torch.isfinite(v).all() for v in diagnostic["state_dict"].values())  # the state before the bad update


def test_non_finite_gradient_with_a_finite_loss_stops_the_run(prepared, tmp_path):
    cfg = compose_config(overrides=[*FAST_TRAIN, f"run_dir={tmp_path}"])
    module, datamodule, run = build_module(cfg), build(cfg.data), build_run_directory(cfg)
    module.model.lm_head.weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([7]), float("inf")))
    trainer = build_trainer(cfg, [build(cfg.callbacks.nonfinite_guard)], accumulate=1, run=run)
    with (
        run.opened(cfg, []),
        pytest.raises(NonFiniteError, match=r"^non-finite gradient at optimizer step 0 \(loss 1"),
    ):
        trainer.fit(module, datamodule=datamodule)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt")) == [
        "nonfinite-step-0000000.ckpt",
        "step-0000000.ckpt",
    ]


class WeightsAt(L.Callback):
    """The model's weights when optimizer step `step` begins (after every earlier update), and each step's loss."""

    def __init__(self, step: int):
        self.step, self.weights, self.losses = step, None, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.weights = {k: v.clone() for k, v in pl_module.state_dict().items()}


@pytest.mark.parametrize("check_every", [1, 5])
def test_a_gradient_planted_non_finite_at_step_k_stops_the_run_at_k_with_the_weights_before_k(prepared, tmp_path,
                                                                                            check_every):
    """The guard reads its verdict every check_every steps: meanwhile the fused AdamW skips every step from the bad one
    on, so that the diagnostic checkpoint holds exactly the weights and optimizer state that step k began with."""
    overrides = [*FAST_TRAIN, "trainer.max_steps=12", "trainer.val_check_interval=12", "checkpoints.every=12",
                 "checkpoints.dense_until=12", "checkpoints.sparse_every=12"]
    k, states = 3, {}
    for planted in (False, True):
        run_dir = tmp_path / f"planted-{planted}"
        cfg = compose_config(overrides=[*overrides, f"run_dir={run_dir}",
                                        f"callbacks.nonfinite_guard.check_every={check_every}"])
        module, datamodule, run = build_module(cfg), build(cfg.data), build_run_directory(cfg)
        if planted:
            module.model.lm_head.weight.register_hook(
                lambda grad, m=module: grad.index_fill(0, torch.tensor([7]), float("nan"))
                if m.trainer.global_step == k else grad)
        states[planted] = WeightsAt(k)
        trainer = build_trainer(cfg, [build(cfg.callbacks.nonfinite_guard), states[planted]], accumulate=1, run=run)
        with run.opened(cfg, []):
            if not planted:
                trainer.fit(module, datamodule=datamodule)
                continue
            found = 5 if check_every == 5 else k + 1
            late = f"; found at step {found}, the steps between skipped" if found > k + 1 else ""
            message = rf"^non-finite gradient at optimizer step {k} \(loss \d.*{re.escape(late)}\); diagnostic "
            with pytest.raises(NonFiniteError, match=message + "checkpoint .*step-0000000.ckpt"):
                trainer.fit(module, datamodule=datamodule)
            assert trainer.global_step == found
        diagnostic = torch.load(run_dir / "checkpoints" / f"nonfinite-step-{k:07d}.ckpt", weights_only=False)
    for name, clean in states[False].weights.items():
        assert torch.equal(diagnostic["state_dict"][name], clean), name
    assert all(s["step"] == k for s in diagnostic["optimizer_states"][0]["state"].values())  # k steps, none since


def test_a_truncated_last_checkpoint_is_skipped_for_the_previous_one(sweep, tmp_path):
    run = Path(shutil.copytree(run_of(sweep, "rmsnorm"), tmp_path / "run"))
    (run / "checkpoints" / "step-0000006.ckpt").unlink()
    with open(run / "checkpoints" / "last.ckpt", "r+b") as f:  # damaged on disk
        f.truncate(1000)
    result = run_cli("normlab-train", "norm=rmsnorm", f"run_dir={run}", *FAST_TRAIN)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "last.ckpt holds 1,000 bytes, its digest file says" in result.stderr
    assert f"resuming {run} from checkpoints/previous.ckpt at step 4" in result.stderr  # the fallback
    assert verify(run / "checkpoints" / "last.ckpt").step == 6  # rewritten, with the scheduled one it lacked
    assert verify(run / "checkpoints" / "step-0000006.ckpt").step == 6
    assert not list((run / "checkpoints").glob(".*.tmp"))  # no temporary file left behind
