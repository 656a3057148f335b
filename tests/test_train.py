"""Real training runs of the tiny model through the real entry point (Hydra -> Lightning, CPU)."""

import csv
import math
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import FAST_TRAIN, compose_config, run_cli
from train.errors import NonFiniteError
from train.cli import build, build_module, build_trainer
from train.angles import read_csv
from train.module import lr_factor

NORMS = ("layernorm", "rmsnorm")


@pytest.fixture(scope="session")
def sweep(prepared, tmp_path_factory) -> Path:
    """`normlab-train -m norm=layernorm,rmsnorm seed=0,1`: four runs, back to back, with Hydra's basic launcher."""
    out = tmp_path_factory.mktemp("checkpoints")
    result = run_cli("normlab-train", "-m", "norm=layernorm,rmsnorm", "seed=0,1", "experiment_name=t", f"paths.output_dir={out}", *FAST_TRAIN)
    assert result.returncode == 0, result.stderr[-3000:]
    return out / "t"


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
    run = sweep / f"tiny-{norm}-seed0"
    config = OmegaConf.load(run / "config.yaml")
    assert config.norm.name == norm and config.run_dir == str(run)
    assert "${" not in (run / "config.yaml").read_text()  # resolved
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["last.ckpt", "step-0000000.ckpt", "step-0000002.ckpt", "step-0000004.ckpt", "step-0000006.ckpt"]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6


@pytest.mark.parametrize("norm", NORMS)
def test_metrics_csv_has_loss_lr_and_tokens_per_second_at_every_step(sweep, norm):
    run = sweep / f"tiny-{norm}-seed0"
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
def test_angles_csv_holds_every_layer_site_and_reference_at_step_0_and_every_checkpoint(sweep, norm):
    run = sweep / f"tiny-{norm}-seed0"
    rows = read_csv(run / "angles.csv")
    assert sorted({r["step"] for r in rows}) == [0, 2, 4, 6]  # the checkpoint schedule
    at_0 = [r for r in rows if r["step"] == 0]
    assert {(r["layer"], r["site"]) for r in at_0} == {(layer, f"{role}.{io}") for layer in range(2) for role in
                                                       ("attn_norm", "mlp_norm") for io in ("input", "output", "rotation")} | {
        (2, "final_norm.input"), (2, "final_norm.output"), (2, "final_norm.rotation")}
    probe_tokens = (88015 // 128) * 128  # the embedded held-out split, in windows of the model's context
    assert {r["count"] for r in at_0 if r["position"] == "all"} == {probe_tokens}
    assert {r["count"] for r in at_0 if r["position"] == "first"} == {probe_tokens // 128}
    ln_out = [r for r in at_0 if r["site"] == "attn_norm.output" and r["reference"] == "uniform"]
    if norm == "layernorm":  # at step 0 gamma = 1, beta = 0: LN's output is orthogonal to 1 by construction
        assert all(abs(r["mean_deg"] - 90) < 1e-3 and r["std_deg"] < 1e-3 for r in ln_out)
    assert all(r["null_std_deg"] == pytest.approx(math.degrees(1 / 8)) for r in rows)  # d = 64


def test_lr_schedule_warms_up_linearly_then_decays_to_ten_percent():
    assert [lr_factor(s, 4, 100, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, 4, 100, 0.1) == 1.0
    assert lr_factor(52, 4, 100, 0.1) == pytest.approx(0.55)  # half-way through the cosine
    assert lr_factor(100, 4, 100, 0.1) == pytest.approx(0.1)
    values = [lr_factor(s, 4, 100, 0.1) for s in range(4, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("norm", NORMS)
def test_step_zero_checkpoint_holds_the_initial_weights(sweep, norm):
    run = sweep / f"tiny-{norm}-seed0"
    initial = build_module(OmegaConf.load(run / "config.yaml")).state_dict()
    step0 = torch.load(run / "checkpoints" / "step-0000000.ckpt", weights_only=False)["state_dict"]
    step6 = torch.load(run / "checkpoints" / "step-0000006.ckpt", weights_only=False)["state_dict"]
    assert step0.keys() == initial.keys()
    assert all(torch.equal(step0[k], initial[k]) for k in initial)
    assert not torch.equal(step6["model.wte.weight"], initial["model.wte.weight"])


def test_ln_and_rms_runs_differ_only_in_norm_parameters(sweep):
    ln = torch.load(sweep / "tiny-layernorm-seed0/checkpoints/step-0000000.ckpt", weights_only=False)["state_dict"]
    rms = torch.load(sweep / "tiny-rmsnorm-seed0/checkpoints/step-0000000.ckpt", weights_only=False)["state_dict"]
    assert rms.keys() <= ln.keys()
    assert all(torch.equal(ln[k], rms[k]) for k in rms)


def snapshot(directory: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_rerunning_the_same_command_resumes_and_a_changed_config_is_refused(sweep, tmp_path):
    run = Path(shutil.copytree(sweep / "tiny-layernorm-seed0", tmp_path / "run"))  # a moved run keeps its identity
    finished = run_cli("normlab-train", "norm=layernorm", f"run_dir={run}", *FAST_TRAIN)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert set(read_metrics(run)["train/loss"]) == set(range(6))  # nothing appended, nothing lost
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6

    before = snapshot(run)
    changed = run_cli("normlab-train", "norm=layernorm", f"run_dir={run}", *FAST_TRAIN, "trainer.max_steps=8")
    assert changed.returncode == 2
    (line,) = changed.stderr.strip().splitlines()
    assert "holds checkpoints of another config (trainer.max_steps: 6 -> 8" in line and "restart=true" in line
    assert snapshot(run) == before  # nothing on disk changed

    restarted = run_cli("normlab-train", "norm=layernorm", f"run_dir={run}", *FAST_TRAIN, "trainer.max_steps=8", "restart=true")
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert set(read_metrics(run)["train/loss"]) == set(range(8))
    (aside,) = tmp_path.glob("run.replaced-*")
    assert snapshot(aside) == {aside / p.relative_to(run): data for p, data in before.items()}  # moved, not deleted


def test_wandb_logs_offline_without_an_account(prepared, tmp_path):
    overrides = [o for o in FAST_TRAIN if not o.startswith("logger=")] + ["trainer.max_steps=2"]
    result = run_cli("normlab-train", f"run_dir={tmp_path}", *overrides,
                     env={"WANDB_MODE": None, "WANDB_API_KEY": None, "WANDB_DIR": None})
    assert result.returncode == 0, result.stderr[-3000:]
    assert list((tmp_path / "wandb").glob("offline-run-*")), "wandb wrote no offline run"
    assert (tmp_path / "metrics.csv").is_file()


def test_report_draws_the_loss_curves_and_summarises_both_norms(sweep, tmp_path):
    result = run_cli("normlab-report", str(sweep), "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    summary = (tmp_path / "summary.md").read_text()
    assert "tiny layernorm seed 0" in summary and "tiny rmsnorm seed 0" in summary
    assert "| 6,541,184 |" in summary and "| 6,540,864 |" in summary  # LN has (2L+1) d = 5 x 64 more
    for figure in ("angles_by_layer_tiny.png", "angles_training_tiny-layernorm-seed0.png", "angles_training_tiny-rmsnorm-seed0.png"):
        assert (tmp_path / figure).stat().st_size > 10_000 and f"({figure})" in summary
    assert "angle to 1 before the norms" in summary
    assert "| tiny layernorm | 2 |" in summary and "| tiny rmsnorm | 2 |" in summary  # mean ± std over the 2 seeds


def test_sweep_ran_every_norm_and_seed_with_its_own_initialisation(sweep):
    runs = sorted(p.name for p in sweep.iterdir() if (p / "metrics.csv").is_file())
    assert runs == [f"tiny-{n}-seed{s}" for n in NORMS for s in (0, 1)]
    seed0 = torch.load(sweep / "tiny-layernorm-seed0/checkpoints/step-0000000.ckpt", weights_only=False)["state_dict"]
    seed1 = torch.load(sweep / "tiny-layernorm-seed1/checkpoints/step-0000000.ckpt", weights_only=False)["state_dict"]
    assert not torch.equal(seed0["model.wte.weight"], seed1["model.wte.weight"])


def test_non_finite_loss_stops_the_run_with_a_diagnostic_checkpoint(prepared, tmp_path):
    result = run_cli("normlab-train", *FAST_TRAIN, f"run_dir={tmp_path}", "model.lr=1e30", "trainer.max_steps=30")
    assert result.returncode == 2
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("normlab-train: error: non-finite loss at optimizer step 1 (loss nan)")
    assert "last good checkpoint" in last_line and "step-0000000.ckpt" in last_line
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["nonfinite-step-0000001.ckpt", "step-0000000.ckpt"]
    diagnostic = torch.load(tmp_path / "checkpoints" / "nonfinite-step-0000001.ckpt", weights_only=False)
    assert diagnostic["global_step"] == 1
    assert all(torch.isfinite(v).all() for v in diagnostic["state_dict"].values())  # the state before the bad update


def test_non_finite_gradient_with_a_finite_loss_stops_the_run(prepared, tmp_path):
    cfg = compose_config(overrides=[*FAST_TRAIN, f"run_dir={tmp_path}"])
    module, datamodule = build_module(cfg), build(cfg.data)
    module.model.lm_head.weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([7]), float("inf")))
    trainer = build_trainer(cfg, [build(cfg.callbacks.nonfinite_guard)], accumulate=1)
    with pytest.raises(NonFiniteError, match=r"^non-finite gradient at optimizer step 0 \(loss 1"):
        trainer.fit(module, datamodule=datamodule)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["nonfinite-step-0000000.ckpt"]


def test_a_truncated_last_checkpoint_is_skipped_for_the_previous_one(sweep, tmp_path):
    run = Path(shutil.copytree(sweep / "tiny-rmsnorm-seed0", tmp_path / "run"))
    (run / "checkpoints" / "step-0000006.ckpt").unlink()
    with open(run / "checkpoints" / "last.ckpt", "r+b") as f:  # a save cut short
        f.truncate(1000)
    result = run_cli("normlab-train", "norm=rmsnorm", f"run_dir={run}", *FAST_TRAIN)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "last.ckpt is unreadable (a save cut short?): skipped" in result.stderr
    assert "Restored all states from the checkpoint at" in result.stderr + result.stdout
    assert "step-0000004.ckpt" in result.stderr + result.stdout  # resumed from the newest complete one
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6
    assert not list((run / "checkpoints").glob(".*.tmp"))  # no temporary file left behind
