"""logger=tensorboard: event files under the run directory."""

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import FAST_TRAIN, run_cli


def events(folder):
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0})
    accumulator.Reload()
    return accumulator


def test_tensorboard_logs_losses_angles_and_the_layer_figure(prepared, tmp_path):
    overrides = [o for o in FAST_TRAIN if not o.startswith(("logger=", "trainer.max_steps="))] + ["logger=tensorboard"]
    first = run_cli("normlab-train", f"run_dir={tmp_path}", *overrides, "trainer.max_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    folder = tmp_path / "tensorboard"
    assert not list(folder.glob("version_*"))
    log = events(folder)
    tags = log.Tags()
    assert sorted(e.step for e in log.Scalars("train/loss")) == list(range(4))
    assert "val/loss" in tags["scalars"]
    assert any(t.startswith("angles-") for t in tags["scalars"])
    assert "angles-figure/angle_to_1_by_layer" in tags["images"]

