"""logger=tensorboard: event files under the run directory, continued in the same folder by a resumed run."""

import signal
import time

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import FAST_TRAIN, Command, start_cli
from test_faults import finish, logged_steps, resumed_step

STEPS = 10
OVERRIDES = [o for o in FAST_TRAIN if not o.startswith(("logger=", "trainer.max_steps="))] + [
    "logger=tensorboard", f"trainer.max_steps={STEPS}"]


def events(folder):
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0})
    accumulator.Reload()
    return accumulator


def start(run_dir) -> Command:
    return start_cli("normlab-train", f"run_dir={run_dir}", *OVERRIDES)


def test_tensorboard_logs_losses_angles_and_the_figure_and_a_resumed_run_writes_on_in_its_folder(prepared, tmp_path):
    first = start(tmp_path)
    deadline = time.monotonic() + 300
    while logged_steps(tmp_path) < 3 and first.poll() is None:
        assert time.monotonic() < deadline, "no training step logged in 300 s"
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    finish(first, 128 + signal.SIGTERM)
    stopped_at = logged_steps(tmp_path)
    assert 3 <= stopped_at < STEPS
    resumed = finish(start(tmp_path))
    assert resumed_step(resumed, tmp_path) == stopped_at

    folder = tmp_path / "tensorboard"
    assert not list(folder.glob("version_*")) and len(list(folder.glob("events.out.tfevents.*"))) == 2  # 2 attempts
    log = events(folder)
    assert [e.step for e in sorted(log.Scalars("train/loss"), key=lambda e: e.wall_time)] == list(range(STEPS))
    assert sorted(e.step for e in log.Scalars("val/loss")) == sorted({e.step for e in log.Scalars("val/loss")})
    tags = log.Tags()
    assert any(t.startswith("angles-") for t in tags["scalars"])
    assert "angles-figure/angle_to_1_by_layer" in tags["images"]
