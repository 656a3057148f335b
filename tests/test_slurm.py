"""The real thing: the project's sbatch script on a one-node Slurm cluster (slurm/local_cluster.sh, which
`make test` starts), DDP over 2 tasks on CPU, SIGUSR1 in the middle of the run, requeue and resume (with dropout,
so that both ranks' random states must be restored)."""

import csv
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train.paths import PROJECT_ROOT

RUN = ["model.n_layer=2", "model.dropout=0.1", "data.batch_size=2", "data.val_tokens=1024", "trainer.max_steps=120", "trainer.val_check_interval=40",
       "callbacks.scheduled_checkpoints.every=40", "callbacks.scheduled_checkpoints.dense_until=40",
       "callbacks.scheduled_checkpoints.sparse_every=120", "logger=csv", "global_batch_size=4", "probe.tokens=4096"]


def cluster_ready() -> bool:
    return shutil.which("sbatch") is not None and subprocess.run(["sinfo"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not cluster_ready() and not os.environ.get("CI"),
                                reason="no Slurm cluster here: run `bash slurm/local_cluster.sh` (root) first")


def sbatch(run_dir: Path, log: Path) -> str:
    env = {**os.environ, "NORMLAB_VENV": sys.prefix}
    result = subprocess.run(["sbatch", "--parsable", f"--output={log}", "slurm/tiny_cpu.sbatch", f"run_dir={run_dir}", *RUN],
                            cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, check=True)
    return result.stdout.strip().split(";")[0]


def state(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True, text=True).stdout.strip()


def wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


def losses(run_dir: Path) -> dict[int, float]:
    if not (run_dir / "metrics.csv").is_file():
        return {}
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def test_usr1_requeues_the_job_which_resumes_and_ends_like_an_uninterrupted_run(prepared, tmp_path):
    assert cluster_ready(), "CI must start the one-node cluster: bash slurm/local_cluster.sh"
    whole = sbatch(tmp_path / "whole", tmp_path / "whole.out")
    wait(lambda: state(whole) == "", 300, "the uninterrupted job")
    reference = losses(tmp_path / "whole")
    assert sorted(reference) == list(range(120)), (tmp_path / "whole.out").read_text()[-3000:]

    job = sbatch(tmp_path / "cut", tmp_path / "cut.out")
    wait(lambda: len(losses(tmp_path / "cut")) >= 20, 180, "20 training steps")
    subprocess.run(["scancel", "--signal=USR1", job], check=True)  # what --signal=SIGUSR1@90 sends before the limit
    wait(lambda: state(job).startswith("PENDING"), 120, "the job to be requeued")
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True)  # skip the requeue delay
    wait(lambda: state(job) == "", 300, "the requeued job")

    log = (tmp_path / "cut.out").read_text()
    assert "SIGUSR1: saved" in log and "Restored all states from the checkpoint" in log, log[-3000:]
    resumed = losses(tmp_path / "cut")
    assert sorted(resumed) == list(range(120))  # no gap, no duplicate step
    assert resumed == reference  # every step's loss, bit for bit, the last one included
