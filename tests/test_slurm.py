"""The real thing: the project's sbatch script on a one-node Slurm cluster (slurm/local_cluster.sh, which
`make test` starts), DDP over 2 tasks on CPU, SIGUSR1 in the middle of the run, requeue and resume (with dropout,
so that both ranks' random states must be restored); the real time limit, again and again; what a site sets (its
set-up file, partition and account); Hydra's submitit launcher."""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cluster_ready, needs_slurm, state, wait
from normlab.common.paths import PROJECT_ROOT
from normlab.training.rundir.checkpoints import verify
from replicas import assert_prepared_from, owt, plant_openwebtext

STEPS = 60  # a signal after 20 steps leaves 40 to resume: a validation and a checkpoint at 30, the last at 60
RUN = [
    "model.n_layer=2",
    "model.dropout=0.1",
    "data.batch_size=2",
    "data.val_tokens=1024",
    f"trainer.max_steps={STEPS}",
    "trainer.val_check_interval=30",
    "checkpoints.every=30",
    "checkpoints.dense_until=30",
    f"checkpoints.sparse_every={STEPS}",
    "logger=csv",
    "global_batch_size=4",
    "probe.tokens=4096",
]


pytestmark = needs_slurm


# A run of 6 steps, for what needs a finished run rather than a long one (after RUN: the last value wins)
SHORT = [
    "trainer.max_steps=6",
    "trainer.val_check_interval=2",
    "checkpoints.every=2",
    "checkpoints.dense_until=4",
    "checkpoints.sparse_every=6",
]


submitted: list[str] = []  # the jobs of the running test


@pytest.fixture(autouse=True)
def cancel_jobs_left_behind():
    """A test that fails leaves no job holding the cluster's CPUs: the next tests' jobs would wait for it."""
    yield
    for job in submitted:
        subprocess.run(["scancel", job], capture_output=True)
    submitted.clear()


def sbatch(run_dir: Path | str, log: Path, *overrides: str, options=(), env: dict | None = None) -> str:
    """Submits slurm/tiny_cpu.sbatch with RUN and `overrides`; `options` go to sbatch, `env` to its environment."""
    result = subprocess.run(
        ["sbatch", "--parsable", f"--output={log}", *options, "slurm/tiny_cpu.sbatch", f"run_dir={run_dir}", *RUN,
         *overrides],
        cwd=PROJECT_ROOT,
        env={**os.environ, "NORMLAB_VENV": sys.prefix, **(env or {})},
        capture_output=True,
        text=True,
        check=True,
    )
    submitted.append(result.stdout.strip().split(";")[0])
    return submitted[-1]


def job_info(job: str) -> dict[str, str]:
    """Slurm's record of a job (JobState, ExitCode, Partition, Restarts...), kept MinJobAge (300 s) after its end."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


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
    assert sorted(losses_whole) == list(range(STEPS)), (out / "whole.out").read_text()[-3000:]
    return losses_whole


def test_usr1_requeues_the_job_which_resumes_and_ends_like_an_uninterrupted_run(reference, tmp_path):
    job = sbatch(tmp_path / "cut", tmp_path / "cut.out")
    wait(lambda: len(losses(tmp_path / "cut")) >= 20, 180, "20 training steps")
    subprocess.run(["scancel", "--signal=USR1", job], check=True)  # what --signal=SIGUSR1@90 sends before the limit
    wait(lambda: state(job).startswith("PENDING"), 120, "the job to be requeued")
    wait(lambda: state(job) == "", 300, "the requeued job")  # it starts cred_expire (local_cluster.sh) later

    log = (tmp_path / "cut.out").read_text()
    saved = re.search(r"SIGUSR1: saved \S+/checkpoints/last.ckpt at step (\d+); requeueing job", log)
    assert saved and f"resuming {tmp_path / 'cut'} from checkpoints/last.ckpt at step {saved.group(1)}" in log, log[
        -3000:
    ]
    resumed = losses(tmp_path / "cut")
    assert sorted(resumed) == list(range(STEPS))  # no gap, no duplicate step
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


def test_each_time_limit_requeues_the_job_which_resumes_where_it_stopped(prepared, tmp_path):
    """The real time limit, twice: with --time=2 --signal=USR1@60 Slurm signals the job about 60 s after it starts
    (its timer ticks every 30 s or so), and every time the run saves, requeues the job and the next start resumes
    from the step saved. 60 s, not 30: on a busy machine two tasks importing torch and Lightning can take 30 s, and
    a signal before the handler is installed kills the task (the job fails, nothing is requeued). One task of one
    thread, paced to a step every 0.2 s or so (tests/pacing.py, a callback given as a user's is): the job trains for
    minutes only to meet its limit, and would otherwise keep a core from the other test workers all that time; the
    USR1 test above requeues a job of two tasks."""
    run, log = tmp_path / "run", tmp_path / "job.out"
    job = sbatch(run, log, "trainer.max_steps=30000", "runtime.threads=1", "+callbacks.pace._target_=pacing.Pace",
                 "+callbacks.pace.seconds=0.2", options=["--time=2", "--signal=USR1@60", "--ntasks-per-node=1"],
                 env={"PYTHONPATH": str(Path(__file__).parent)})
    resume = rf"resuming {run} from checkpoints/last\.ckpt at step (\d+)"

    def resumed_twice() -> bool:
        return log.is_file() and len(re.findall(resume, log.read_text())) >= 2

    wait(resumed_twice, 480, "two requeues at the time limit")
    assert int(job_info(job)["Restarts"]) == 2
    second = int(re.findall(resume, log.read_text())[1])
    wait(lambda: len(losses(run)) > second, 120, "a step trained after the second resume")  # then cancel it
    subprocess.run(["scancel", job], check=True)
    wait(lambda: state(job) == "", 120, "the job to end")

    text = log.read_text()
    saved = re.findall(rf"SIGUSR1: saved {run}/checkpoints/last\.ckpt at step (\d+); requeueing job {job}", text)
    assert saved[:2] == re.findall(resume, text)[:2] and 0 < int(saved[0]) < int(saved[1]), text[-3000:]
    steps = sorted(losses(run))
    assert steps == list(range(len(steps))) and len(steps) > int(saved[1])  # no gap, no step twice


def test_a_requeued_job_of_a_finished_run_ends_at_once_and_cleanly(prepared, tmp_path):
    run, log = tmp_path / "run", tmp_path / "job.out"
    job = sbatch(run, log, *SHORT)
    wait(lambda: state(job) == "", 300, "the job")
    finished = losses(run)
    assert sorted(finished) == list(range(6)), log.read_text()[-3000:]
    subprocess.run(["scontrol", "requeue", job], check=True)  # as Slurm does after a node failure, say

    seen: list[str] = []  # the states the requeued job went through: the evidence if it never ends

    def requeued_job_ended() -> bool:  # its line in the log too: between the requeue and its start, squeue may not
        now = state(job)  # list the job for a moment, which a loaded machine can hit
        if not seen or seen[-1] != now:
            seen.append(now)
        return now == "" and job_info(job)["Restarts"] == "1" and "nothing to do" in log.read_text()

    try:  # a busy machine (the other test worker training) starts a job slowly: generous, with the evidence
        wait(requeued_job_ended, 480, "the requeued job")
    except AssertionError as e:
        raise AssertionError(f"{e}: states {seen}, {job_info(job)}, log ends {log.read_text()[-1500:]!r}") from None

    assert f"{run} is finished (step 6 of 6): nothing to do" in log.read_text()
    info = job_info(job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1")
    assert losses(run) == finished


def test_the_site_file_runs_before_the_training_and_exports_to_every_task(prepared, tmp_path):
    """NORMLAB_SITE_ENV names a file that slurm/env.sh sources on the node (modules, conda): here it prints a line
    and exports the run directory, which both tasks then read from their environment."""
    site = tmp_path / "site.sh"
    site.write_text(f'echo "site file sourced by job $SLURM_JOB_ID"\nexport NORMLAB_TEST_RUN_DIR={tmp_path}/run\n')
    log = tmp_path / "job.out"
    job = sbatch("${oc.env:NORMLAB_TEST_RUN_DIR}", log, *SHORT, env={"NORMLAB_SITE_ENV": str(site)})
    wait(lambda: state(job) == "", 300, "the job")
    assert log.read_text().startswith(f"site file sourced by job {job}\n"), log.read_text()[-3000:]
    assert sorted(losses(tmp_path / "run")) == list(range(6))
    assert job_info(job)["ExitCode"] == "0:0"


def test_a_missing_site_file_fails_the_job_in_one_line_before_anything_runs(tmp_path):
    log = tmp_path / "job.out"
    job = sbatch(tmp_path / "run", log, env={"NORMLAB_SITE_ENV": "no/such/site.sh"})
    wait(lambda: state(job) == "", 300, "the job")
    assert log.read_text() == (
        f"slurm/env.sh: no readable file {PROJECT_ROOT.resolve()}/no/such/site.sh (NORMLAB_SITE_ENV): "
        "fix the path or unset NORMLAB_SITE_ENV\n"
    )
    info = job_info(job)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0")
    assert not (tmp_path / "run").exists()


def test_a_prepare_job_reads_a_copy_offline_and_logs_a_line_per_archive(prepared, tmp_path):
    """slurm/prepare.sbatch on a compute node (slurm/env.sh: no hub), from a local copy of OpenWebText's layout: a
    tokenizer process per CPU of the job, a line per archive in the job's log and no carriage returns."""
    documents = plant_openwebtext(tmp_path / "copy")
    log = tmp_path / "prepare.out"
    result = subprocess.run(
        ["sbatch", "--parsable", f"--output={log}", "--cpus-per-task=2", "--mem=1", "slurm/prepare.sbatch",
         *owt(tmp_path / "corpus", f"data.source.path={tmp_path / 'copy'}")],
        cwd=PROJECT_ROOT, env={**os.environ, "NORMLAB_VENV": sys.prefix}, capture_output=True, text=True, check=True)
    submitted.append(job := result.stdout.strip().split(";")[0])
    wait(lambda: state(job) == "", 300, "the prepare job")
    text = log.read_text()
    assert job_info(job)["ExitCode"] == "0:0", text[-3000:]
    assert [line.split(":")[0] for line in text.splitlines() if line.startswith("archive ")] == [
        f"archive {a + 1}/3 urlsf_subset{a:02d}.tar" for a in range(3)]
    assert "\r" not in text and "prepared openwebtext in" in text
    assert_prepared_from(tmp_path / "corpus", documents)


def test_partition_and_account_come_from_the_environment_and_the_command_line_wins(tmp_path):
    env = {"SBATCH_PARTITION": "second", "SBATCH_ACCOUNT": "normlab-lab"}  # second: see slurm/local_cluster.sh
    from_env = sbatch(tmp_path / "a", tmp_path / "a.out", options=["--hold"], env=env)
    from_args = sbatch(tmp_path / "b", tmp_path / "b.out", options=["--hold", "-p", "debug", "-A", "other"], env=env)
    try:
        assert (job_info(from_env)["Partition"], job_info(from_env)["Account"]) == ("second", "normlab-lab")
        assert (job_info(from_args)["Partition"], job_info(from_args)["Account"]) == ("debug", "other")
    finally:
        subprocess.run(["scancel", from_env, from_args], check=True)


def test_the_submitit_launcher_sizes_the_job_and_its_time_out_saves_before_submitit_requeues(reference, tmp_path):
    """normlab-train -m hydra/launcher=slurm_a6000 for real, on CPUs (no GPUs nor memory per GPU): 2 tasks from
    trainer.devices, the partition from SBATCH_PARTITION, the site file sourced by env.sh in the job. Then the
    signal submitit asks Slurm to send before the time limit (USR2): the run finishes its step and saves, and only
    then submitit requeues the job, which resumes from that step and ends like an uninterrupted run."""
    site = tmp_path / "site.sh"
    site.write_text('echo "site file sourced by job $SLURM_JOB_ID"\n')
    command = [
        str(Path(sys.executable).parent / "normlab-train"),
        "-m",
        "hydra/launcher=slurm_a6000",
        "hydra.launcher.gpus_per_node=null",
        "hydra.launcher.mem_per_gpu=null",
        "hydra.launcher.cpus_per_task=1",
        "trainer.accelerator=cpu",
        "trainer.strategy=ddp",
        "trainer.devices=2",
        *RUN,
        f"paths.output_dir={tmp_path}",
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "NORMLAB_SITE_ENV": str(site), "SBATCH_PARTITION": "second",
           "NORMLAB_VENV": sys.prefix}
    sweep = subprocess.Popen(command, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        wait(lambda: list((tmp_path / "default").glob("tiny-layernorm-seed0-*/metrics.csv")), 180, "the job to start")
        [script] = (tmp_path / "default" / ".submitit").glob("*/*_submission.sh")
        job = script.name.split("_")[0]
        submitted.append(job)
        [run] = (tmp_path / "default").glob("tiny-layernorm-seed0-*")
        wait(lambda: len(losses(run)) >= 20, 180, "20 training steps")
        subprocess.run(["scancel", "--signal=USR2", job], check=True)  # what --signal=USR2@90 sends before the limit
        wait(lambda: state(job).startswith("PENDING"), 120, "the job to be requeued")
        out, _ = sweep.communicate(timeout=400)
    finally:
        sweep.kill()
    assert sweep.returncode == 0, out[-3000:]

    sbatch_lines = set(re.findall(r"^#SBATCH (\S+)$", script.read_text(), flags=re.MULTILINE))
    assert {"--partition=second", "--ntasks-per-node=2", "--nodes=1", "--time=1440", "--signal=USR2@90"} <= \
        sbatch_lines
    log = (script.parent / f"{job}_0_log.out").read_text() + (script.parent / f"{job}_0_log.err").read_text()
    assert log.startswith(f"site file sourced by job {job}\n")
    saved = re.search(r"normlab-train: SIGUSR2: saved \S+/last.ckpt at step (\d+); submitit requeues the job", log)
    assert saved and f"resuming {run} from checkpoints/last.ckpt at step {saved.group(1)}" in log, log[-3000:]
    assert int(job_info(job)["Restarts"]) == 1
    assert losses(run) == reference  # no gap, no step twice, every loss as without the interruption
