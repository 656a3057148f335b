"""The real thing: the project's sbatch script on a one-node Slurm cluster (slurm/local_cluster.sh, which
`make test` starts), DDP over 2 tasks on CPU, SIGUSR1 in the middle of the run, requeue and resume (with dropout,
so that both ranks' random states must be restored)."""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cluster_ready, needs_slurm, state, wait
from normlab.paths import PROJECT_ROOT
from normlab.run_dir import verify

RUN = [
    "model.n_layer=2",
    "model.dropout=0.1",
    "data.batch_size=2",
    "data.val_tokens=1024",
    "trainer.max_steps=120",
    "trainer.val_check_interval=40",
    "callbacks.scheduled_checkpoints.every=40",
    "callbacks.scheduled_checkpoints.dense_until=40",
    "callbacks.scheduled_checkpoints.sparse_every=120",
    "logger=csv",
    "global_batch_size=4",
    "probe.tokens=4096",
]


pytestmark = needs_slurm


def sbatch(run_dir: Path, log: Path) -> str:
    env = {**os.environ, "NORMLAB_VENV": sys.prefix}
    result = subprocess.run(
        ["sbatch", "--parsable", f"--output={log}", "slurm/tiny_cpu.sbatch", f"run_dir={run_dir}", *RUN],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip().split(";")[0]


def losses(run_dir: Path) -> dict[int, float]:
    if not (run_dir / "metrics.csv").is_file():
        return {}
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


@pytest.fixture(scope="module")
def reference(prepared, tmp_path_factory) -> dict[int, float]:
    """The losses of the uninterrupted job."""
    assert cluster_ready(), "CI must start the one-node cluster: bash slurm/local_cluster.sh"
    out = tmp_path_factory.mktemp("whole")
    whole = sbatch(out / "run", out / "whole.out")
    wait(lambda: state(whole) == "", 300, "the uninterrupted job")
    losses_whole = losses(out / "run")
    assert sorted(losses_whole) == list(range(120)), (out / "whole.out").read_text()[-3000:]
    return losses_whole


def test_usr1_requeues_the_job_which_resumes_and_ends_like_an_uninterrupted_run(reference, tmp_path):
    job = sbatch(tmp_path / "cut", tmp_path / "cut.out")
    wait(lambda: len(losses(tmp_path / "cut")) >= 20, 180, "20 training steps")
    subprocess.run(["scancel", "--signal=USR1", job], check=True)  # what --signal=SIGUSR1@90 sends before the limit
    wait(lambda: state(job).startswith("PENDING"), 120, "the job to be requeued")
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True)  # skip the requeue delay
    wait(lambda: state(job) == "", 300, "the requeued job")

    log = (tmp_path / "cut.out").read_text()
    saved = re.search(r"SIGUSR1: saved \S+/checkpoints/last.ckpt at step (\d+); requeueing job", log)
    assert saved and f"resuming {tmp_path / 'cut'} from checkpoints/last.ckpt at step {saved.group(1)}" in log, log[
        -3000:
    ]
    resumed = losses(tmp_path / "cut")
    assert sorted(resumed) == list(range(120))  # no gap, no duplicate step
    assert resumed == reference  # every step's loss, bit for bit, the last one included


def test_sigterm_saves_and_ends_the_job_which_a_new_submission_resumes(reference, tmp_path):
    """scancel --signal=TERM (as a preemption or `scancel` sends): both tasks finish the step, rank 0 saves, the job
    ends with 143 and is not requeued; the same sbatch command resumes it."""
    job = sbatch(tmp_path / "run", tmp_path / "first.out")
    wait(lambda: len(losses(tmp_path / "run")) >= 20, 180, "20 training steps")
    subprocess.run(["scancel", "--signal=TERM", job], check=True)
    wait(lambda: state(job) == "", 120, "the job to end")
    log = (tmp_path / "first.out").read_text()
    saved = re.search(r"SIGTERM: saved \S+/checkpoints/last.ckpt at step (\d+); run the same command", log)
    assert saved and "requeue" not in log, log[-3000:]
    assert (
        verify(tmp_path / "run" / "checkpoints" / "last.ckpt").step
        == int(saved.group(1))
        == len(losses(tmp_path / "run"))
    )

    second = sbatch(tmp_path / "run", tmp_path / "second.out")
    wait(lambda: state(second) == "", 300, "the second job")
    assert f"from checkpoints/last.ckpt at step {saved.group(1)}" in (tmp_path / "second.out").read_text()
    assert losses(tmp_path / "run") == reference
