"""Faults a real cluster produces, injected into real `normlab-train` runs (with dropout, so that random states
matter), on a schedule like the paper's: validations (and last.ckpt) every 3 steps, denser than the scheduled
checkpoints (every 12). Each test measures what the fault cost (the step a run resumed from, the exit status,
the rows kept) and that the run then ends exactly as an uninterrupted one: metrics.csv row for row, angles.csv
byte for byte, the final weights bit for bit."""

import csv
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import Command, start_cli
from normlab.training.rundir.checkpoints import verify
from normlab.training.rundir.files import RunDirError

VAL_EVERY = 3
RUN = [
    "model.n_layer=2",
    "model.dropout=0.1",
    "data.batch_size=2",
    "data.val_tokens=1024",
    "probe.tokens=4096",
    "trainer.max_steps=36",
    f"trainer.val_check_interval={VAL_EVERY}",
    "checkpoints.every=12",
    "checkpoints.dense_until=12",
    "checkpoints.sparse_every=12",
    "logger=csv",
]
TIMING = ("train/tokens_per_sec", "train/tokens_per_sec_per_device")  # wall-clock measurements differ run to run


def start(*args: str) -> Command:
    return start_cli("normlab-train", *args, *RUN)


def finish(process: Command, expected: int = 0) -> str:
    _, err = process.communicate(timeout=300)
    assert process.returncode == expected, err[-3000:]
    return err


def logged_steps(run_dir: Path) -> int:
    """Training steps with their row in metrics.csv."""
    try:
        with open(run_dir / "metrics.csv", newline="") as f:
            return sum(1 for row in csv.DictReader(f) if row.get("train/loss"))
    except FileNotFoundError:
        return 0


def saving(run_dir: Path) -> bool:
    return any((run_dir / "checkpoints").glob(".*.tmp"))


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


def wait_for(process: Command, condition, timeout: float = 120) -> bool:
    """Poll until condition() holds (True) or the process ends (False)."""
    deadline = time.monotonic() + timeout
    while process.poll() is None:
        if condition():
            return True
        assert time.monotonic() < deadline, "the training run made no progress"
        time.sleep(0.001)
    return False


def intact_full_step(run_dir: Path) -> int:
    """The highest step of an intact full checkpoint: what a restart must resume from (0: none)."""
    steps = [0]
    for name in ("last.ckpt", "previous.ckpt"):
        try:
            steps.append(verify(run_dir / "checkpoints" / name).step)
        except RunDirError:
            pass
    return max(steps)


def resumed_step(stderr: str, run_dir: Path) -> int:
    found = re.search(rf"resuming {re.escape(str(run_dir))} from checkpoints/\S+ at step (\d+)", stderr)
    return int(found.group(1)) if found else 0


def metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


def final_weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def assert_same_run(run_dir: Path, reference: Path) -> None:
    assert metrics(run_dir) == metrics(reference)  # every step once, same losses bit for bit, same val rows
    assert (run_dir / "angles.csv").read_bytes() == (reference / "angles.csv").read_bytes()
    reference_weights, weights = final_weights(reference), final_weights(run_dir)
    assert all(torch.equal(tensor, weights[name]) for name, tensor in reference_weights.items())
    assert not list(run_dir.glob(".claim")) and not saving(run_dir)  # claim released, no temporary file left


@pytest.fixture(scope="module")
def whole(prepared, tmp_path_factory) -> Path:
    """The uninterrupted run."""
    run = tmp_path_factory.mktemp("whole") / "run"
    finish(start(f"run_dir={run}"))
    return run


def test_sigkill_at_any_instant_loses_at_most_the_steps_since_the_last_validation(whole, tmp_path):
    run, rng, kills = tmp_path / "killed", random.Random(0), []
    plan = ["save", "steps", "save", "steps"]  # in the middle of a checkpoint save, and between steps
    previous_err, ended = "", False
    for kind in plan:
        for _ in range(3):  # a save seen in progress can end before the kill lands (a fast save): then again
            process = start(f"run_dir={run}")
            before = logged_steps(run)
            if kind == "save":
                condition = nth_save(run, rng.randint(1, 3))
            else:
                target = before + rng.randint(2, 6)
                condition = lambda: logged_steps(run) >= target  # noqa: E731
            if not wait_for(process, condition):
                ended = True
                break
            process.send_signal(signal.SIGKILL)
            err = finish(process, -signal.SIGKILL)
            cut_short = kind == "steps" or saving(run)
            if kills:  # the attempt resumed from the newest intact checkpoint the previous kill had left
                assert resumed_step(err, run) == kills[-1]["expected resume"]
                assert f"taking over the claim on {run} of pid {kills[-1]['pid']}" in err  # the stale claim
            done = logged_steps(run)
            expected = intact_full_step(run)
            # the promise: a kill loses at most the steps since the last validation
            assert expected % VAL_EVERY == 0 and 0 <= done - expected <= VAL_EVERY, (done, expected)
            kills.append({"kind": kind if cut_short else "just after a save", "steps done": done,
                          "expected resume": expected, "pid": process.pid})
            previous_err = err
            if cut_short:
                break
        if ended:
            break
        assert kills[-1]["kind"] == kind, f"no kill of 3 cut a save short: {kills}"
    final = start(f"run_dir={run}")
    err = finish(final)
    assert [k["kind"] for k in kills if k["kind"] in plan] == plan, f"the run ended before every kill: {kills}"
    assert resumed_step(err, run) == kills[-1]["expected resume"] and previous_err
    assert sum(k["steps done"] - k["expected resume"] for k in kills) > 0  # the kills did cost work: measured
    assert_same_run(run, whole)


def stopped_by(signum: int, run: Path, after_steps: int) -> int:
    """Start the run, send `signum` once it has logged `after_steps` steps: exit 128 + signum, one line naming
    last.ckpt and the step it was in, which last.ckpt holds (nothing lost). That step."""
    process = start(f"run_dir={run}")
    assert wait_for(process, lambda: logged_steps(run) >= after_steps)
    process.send_signal(signum)
    err = finish(process, 128 + signum)
    stopped_at = logged_steps(run)
    assert err.strip().splitlines()[-1] == (
        f"normlab-train: error: {signal.Signals(signum).name}: saved {run}/checkpoints/last.ckpt at "
        f"step {stopped_at}; run the same command to resume from it"
    )
    assert verify(run / "checkpoints" / "last.ckpt").step == stopped_at  # nothing lost: the step it was in is saved
    return stopped_at


def test_sigterm_saves_the_step_exits_143_and_a_copied_damaged_run_resumes_exactly(whole, tmp_path):
    """SIGTERM mid-run: the step finishes, last.ckpt holds it, exit 143, no step lost. Then the run directory is
    copied (cp -r gives every file a new time: last.ckpt becomes the oldest), a torn row is appended to metrics.csv
    and angles.csv loses its tail mid-row: the copy resumes from the step inside last.ckpt, drops the torn rows,
    measures the lost angle rows again from the scheduled checkpoint, and ends as the uninterrupted run."""
    run = tmp_path / "run"
    stopped_at = stopped_by(signal.SIGTERM, run, after_steps=14)

    copy = Path(shutil.copytree(run, tmp_path / "copy"))
    os.utime(copy / "checkpoints" / "last.ckpt", (1e9, 1e9))  # older than every other checkpoint
    with open(copy / "metrics.csv", "a") as f:
        f.write(f"{stopped_at + 1},0.0029,")  # a row cut short
    angles = (copy / "angles.csv").read_bytes()
    (copy / "angles.csv").write_bytes(angles[: len(angles) - 5000])  # the last rows of step 12, cut mid-row
    err = finish(start(f"run_dir={copy}"))
    assert resumed_step(err, copy) == stopped_at
    assert f"{copy}/metrics.csv: dropped 1 torn or damaged row" in err
    assert "angles.csv: measured step 12 again from step-0000012.ckpt" in err
    assert_same_run(copy, whole)


def test_ctrl_c_saves_the_step_exits_130_and_a_second_ctrl_c_ends_the_process_at_once(whole, tmp_path):
    """Ctrl-C (SIGINT) mid-run stops as SIGTERM does: the step finishes, last.ckpt holds it, exit 130, and the same
    command resumes from it. A second Ctrl-C while the first one's checkpoint is being saved ends the process at
    once (killed by the signal, the save cut short, as by SIGKILL): the next start resumes from the newest intact
    checkpoint, and the run ends as the uninterrupted one."""
    run = tmp_path / "run"
    stopped_at = stopped_by(signal.SIGINT, run, after_steps=7)

    for _ in range(3):  # the second Ctrl-C must land mid-save; on a loaded machine the save may end before it does
        process = start(f"run_dir={run}")
        done = next(n for n in range(stopped_at + 2, stopped_at + 2 + VAL_EVERY) if n % VAL_EVERY == 1)
        assert wait_for(process, lambda: logged_steps(run) >= done)
        process.send_signal(signal.SIGINT)  # in step done + 1, which neither validates nor saves on its own
        assert wait_for(process, lambda: saving(run))  # the save that the first Ctrl-C asked for
        process.send_signal(signal.SIGINT)
        err = finish(process, -signal.SIGINT)  # ended by the signal itself: no handler ran, nothing more was written
        assert resumed_step(err, run) == stopped_at
        assert "normlab-train: Ctrl-C: stopping after this step, its progress saved; a second Ctrl-C stops" in err
        if saving(run):  # the save was cut short
            break
        stopped_at = intact_full_step(run)  # the save ended first: the next start resumes from it; try again
    assert saving(run)
    expected = intact_full_step(run)
    assert expected >= stopped_at
    err = finish(start(f"run_dir={run}"))
    assert resumed_step(err, run) == expected
    assert f"removing {run}/checkpoints/." in err and f"taking over the claim on {run} of pid {process.pid}" in err
    assert_same_run(run, whole)


def test_ctrl_c_stops_a_sweep_and_says_which_jobs_did_not_run(prepared, tmp_path):
    sweep = ["-m", "norm=layernorm,rmsnorm", "experiment_name=sweep", f"paths.output_dir={tmp_path}"]
    process = start(*sweep)
    runs = tmp_path / "sweep"
    assert wait_for(process, lambda: any(logged_steps(r) >= 2 for r in runs.glob("tiny-layernorm-*")))
    process.send_signal(signal.SIGINT)
    err = finish(process, 128 + signal.SIGINT)
    (ln_run,) = runs.glob("tiny-layernorm-*")
    stopped_at = logged_steps(ln_run)
    assert err.strip().splitlines()[-1] == (
        f"normlab-train: error: SIGINT: saved {ln_run}/checkpoints/last.ckpt at step {stopped_at}; run the same "
        "command to resume from it; jobs not run: norm=rmsnorm (run the same command again: finished runs are "
        "skipped)"
    )
    assert verify(ln_run / "checkpoints" / "last.ckpt").step == stopped_at
    assert not list(runs.glob("tiny-rmsnorm-*"))  # the second job never started


def test_sigusr1_stops_a_sweep_and_says_which_jobs_did_not_run(whole, tmp_path):
    """SIGUSR1 outside Slurm (nothing to requeue) stops like SIGTERM, with its own exit code; in a sweep, before the
    next job."""
    sweep = ["-m", "norm=layernorm,rmsnorm", "experiment_name=sweep", f"paths.output_dir={tmp_path}"]
    process = start(*sweep)
    runs = tmp_path / "sweep"
    assert wait_for(process, lambda: any(logged_steps(r) >= 5 for r in runs.glob("tiny-layernorm-*")))
    process.send_signal(signal.SIGUSR1)
    err = finish(process, 128 + signal.SIGUSR1)
    last_line = err.strip().splitlines()[-1]
    (ln_run,) = runs.glob("tiny-layernorm-*")
    stopped_at = logged_steps(ln_run)
    assert last_line == (f"normlab-train: error: SIGUSR1: saved {ln_run}/checkpoints/last.ckpt at step {stopped_at}; "
                         "run the same command to resume from it; jobs not run: norm=rmsnorm (run the same command "
                         "again: finished runs are skipped)")
    assert not list(runs.glob("tiny-rmsnorm-*"))  # the second job never started

    finish(start(*sweep))  # the same command again: the first run resumes, the second runs
    (rms_run,) = runs.glob("tiny-rmsnorm-*")
    assert_same_run(ln_run, whole)
    assert logged_steps(rms_run) == 36


def test_a_second_start_on_a_run_in_use_is_refused_and_the_first_is_undisturbed(whole, tmp_path):
    run = tmp_path / "run"
    first = start(f"run_dir={run}")
    assert wait_for(first, lambda: logged_steps(run) >= 2)
    first.send_signal(signal.SIGSTOP)  # paused, holding the claim: however fast this machine, it is still in use
    try:
        err = finish(start(f"run_dir={run}"), 2)
    finally:
        first.send_signal(signal.SIGCONT)
    (line,) = err.strip().splitlines()
    assert line.startswith(f"normlab-train: error: {run} is in use by pid {first.pid} on ")
    assert "one process per run directory" in line
    finish(first)
    assert_same_run(run, whole)  # every step once: the second start wrote nothing


def flip_bytes(path: Path) -> None:
    """Corrupt bytes in the middle of the file (inside a tensor record: the zip index stays intact)."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        data = f.read(64)
        f.seek(-len(data), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))


def test_corrupted_checkpoints_are_skipped_for_the_previous_one_and_rewritten(whole, tmp_path):
    run = Path(shutil.copytree(whole, tmp_path / "run"))
    flip_bytes(run / "checkpoints" / "last.ckpt")
    flip_bytes(run / "checkpoints" / "step-0000036.ckpt")
    torch.load(
        run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True
    )  # still loads: only the digest tells
    err = finish(start(f"run_dir={run}"))
    assert f"{run}/checkpoints/last.ckpt does not match the sha256 in its digest file" in err
    assert resumed_step(err, run) == 36 - VAL_EVERY  # previous.ckpt: one validation interval of work
    assert verify(run / "checkpoints" / "last.ckpt").step == 36  # both rewritten when the run passed step 36
    assert verify(run / "checkpoints" / "step-0000036.ckpt").step == 36
    assert_same_run(run, whole)


@pytest.fixture
def small_disk(tmp_path):
    """A 150 MB file system: room for step 0's weights (26 MB) and one last.ckpt (79 MB), not for a second."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=150M", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_disk_full_during_a_save_stops_in_one_line_and_keeps_the_last_checkpoint(whole, small_disk):
    run = small_disk / "run"
    err = finish(start(f"run_dir={run}"), 2)
    last_line = err.strip().splitlines()[-1]
    assert last_line.startswith(f"normlab-train: error: no space left on device while writing {run}/checkpoints/")
    assert "free space on that file system, or give another run_dir; the earlier files are intact" in last_line
    assert verify(run / "checkpoints" / "last.ckpt").step == VAL_EVERY and not saving(run)
    subprocess.run(["mount", "-o", "remount,size=400M", str(small_disk)], check=True)
    err = finish(start(f"run_dir={run}"))
    assert resumed_step(err, run) == VAL_EVERY
    assert_same_run(run, whole)
