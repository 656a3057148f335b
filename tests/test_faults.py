"""Fault injection: a tiny training run (with dropout, so that random states matter) is killed with SIGKILL at
random points, one of them in the middle of a checkpoint save, and restarted with the same command each time.
It must end exactly as the uninterrupted run: losses bit for bit, metrics.csv and angles.csv row for row, the
final weights."""

import csv
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import torch

from conftest import BIN

RUN = ["model.n_layer=2", "model.dropout=0.1", "data.batch_size=2", "data.val_tokens=1024", "probe.tokens=4096",
       "trainer.max_steps=24", "trainer.val_check_interval=4", "callbacks.scheduled_checkpoints.every=4",
       "callbacks.scheduled_checkpoints.dense_until=12", "callbacks.scheduled_checkpoints.sparse_every=12", "logger=csv"]
TIMING = ("train/tokens_per_sec", "train/tokens_per_sec_per_device")  # wall-clock measurements differ run to run


def start(run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "normlab-train"), f"run_dir={run_dir}", *RUN], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "WANDB_MODE": "offline"})


def logged_steps(run_dir: Path) -> int:
    try:
        with open(run_dir / "metrics.csv", newline="") as f:
            return sum(1 for row in csv.DictReader(f) if row["train/loss"])
    except (FileNotFoundError, KeyError):
        return 0


def saving(run_dir: Path) -> bool:
    return any((run_dir / "checkpoints").glob(".*.ckpt.tmp"))


def nth_save(run_dir: Path, n: int):
    """A condition that holds during the n-th checkpoint save seen from now on."""
    seen, was_saving = 0, False

    def condition() -> bool:
        nonlocal seen, was_saving
        now = saving(run_dir)
        seen += now and not was_saving
        was_saving = now
        return now and seen >= n

    return condition


def kill_when(process: subprocess.Popen, condition, timeout: float = 120) -> bool:
    """SIGKILL the process as soon as condition() holds; False if it ended first."""
    deadline = time.monotonic() + timeout
    while process.poll() is None:
        if condition():
            process.send_signal(signal.SIGKILL)
            process.wait()
            return True
        assert time.monotonic() < deadline, "the training run made no progress"
        time.sleep(0.001)
    return False


def metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


def final_weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def test_killed_and_restarted_runs_end_exactly_like_an_uninterrupted_run(prepared, tmp_path):
    whole = start(tmp_path / "whole")
    assert whole.wait(timeout=300) == 0, whole.stderr.read()[-3000:]

    run, rng, kills = tmp_path / "killed", random.Random(0), []
    plan = ["save", "steps", "save", "steps"]  # kill in the middle of a checkpoint save, and between steps
    for kind in plan:
        process, before = start(run), logged_steps(run)
        if kind == "save":
            killed = kill_when(process, nth_save(run, rng.randint(1, 3)))
        else:
            target = before + rng.randint(1, 6)
            killed = kill_when(process, lambda: logged_steps(run) >= target)
        if not killed:
            break
        kills.append((kind, logged_steps(run)))
        if kind == "save":
            assert saving(run), "the kill should have cut a save short"
        for checkpoint in (run / "checkpoints").glob("*.ckpt"):  # every checkpoint written before the kill is whole
            torch.load(checkpoint, map_location="cpu", weights_only=True)
    final = start(run)
    _, err = final.communicate(timeout=300)
    assert final.returncode == 0, err[-3000:]

    assert [k for k, _ in kills] == plan, f"the run ended before every kill: {kills}"
    assert metrics(run) == metrics(tmp_path / "whole")  # every step once, same losses bit for bit, same val rows
    assert (run / "angles.csv").read_text() == (tmp_path / "whole" / "angles.csv").read_text()
    for name, tensor in final_weights(tmp_path / "whole").items():
        assert torch.equal(tensor, final_weights(run)[name]), name
    assert not saving(run)  # the killed save's temporary file was cleaned up
