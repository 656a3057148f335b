"""The run directory's claim: one process per run directory, a stale claim taken over, never a live one; the
CSV tables' torn rows, and lost validation rows regenerated; a run written before classes and keys moved resumed;
the checkpoint schedule's steps. Real files, real processes, the real one-node Slurm cluster (`make test` starts
it)."""

import fcntl
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import FAST_TRAIN, cluster_ready, needs_slurm, run_cli, run_of, state, wait, written_before
from normlab.study.report.groups import Declared, group_runs
from normlab.study.report.runs import find_runs
from normlab.training.loader import load_model
from normlab.training.rundir.checkpoints import checkpoint_steps, write_checkpoint
from normlab.training.rundir.claim import Claim, process_start, this_process
from normlab.training.rundir.files import RunDirError
from normlab.training.rundir.tables import read_table

SMOKE = Declared(learning_check="off")  # runs of a few steps, which learned nothing yet, compared all the same


def claim_of(run, **holder) -> Claim:
    run.mkdir(exist_ok=True)
    (run / ".claim").write_text(json.dumps({**this_process(), **holder}))
    return Claim(run / ".claim")


def test_a_held_claim_refuses_a_second_holder_and_is_gone_once_released(tmp_path):
    first, second = Claim(tmp_path / ".claim"), Claim(tmp_path / ".claim")
    first.acquire()
    with pytest.raises(RunDirError, match=rf"^{tmp_path} is in use by pid \d+ on {socket.gethostname()}, since "):
        second.acquire()  # the lock is held (here by another open file of the same process)
    first.release()
    assert not (tmp_path / ".claim").exists()
    second.acquire()
    second.release()


def test_a_claim_locked_before_its_holder_wrote_its_name_is_described_as_such(tmp_path):
    path = tmp_path / ".claim"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # another start: created and locked, nothing written yet
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(RunDirError, match=rf"^{tmp_path} is in use by another start that is just claiming it: "):
            Claim(path).acquire()
    finally:
        os.close(fd)
    assert path.read_bytes() == b""


def test_rank_0_of_a_finished_run_leaves_its_choice_for_the_other_ranks_of_its_launch(tmp_path, capsys):
    """Rank 0 finds the run finished and exits at once; a rank that looks only afterwards must still read the choice
    (not wait RANK_WAIT_SECONDS for a claim that will never come), and the next start takes the claim silently."""
    rank_0 = Claim(tmp_path / ".claim")
    rank_0.acquire()
    rank_0.update({**this_process(), "resume": {"path": "checkpoints/last.ckpt", "step": 6}})
    rank_0.release(for_other_ranks=True)
    late_rank = Claim(tmp_path / ".claim").join(timeout=1)  # this process stands in for a rank of the same launch
    assert late_rank["resume"] == {"path": "checkpoints/last.ckpt", "step": 6} and late_rank["released"]
    next_start = Claim(tmp_path / ".claim")
    next_start.acquire()
    assert "taking over" not in capsys.readouterr().err  # a released record is no claim
    next_start.release()
    assert not (tmp_path / ".claim").exists()


def test_the_claim_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, capsys):
    dead = subprocess.Popen(["true"])
    dead.wait()
    claim = claim_of(tmp_path, pid=dead.pid, pid_start=1)
    claim.acquire()
    err = capsys.readouterr().err
    assert f"taking over the claim on {tmp_path} of pid {dead.pid}" in err
    assert err.rstrip().endswith(f": pid {dead.pid} is no longer running")
    assert json.loads((tmp_path / ".claim").read_text())["pid"] == this_process()["pid"]
    claim.release()


def test_the_claim_of_a_pid_that_is_now_another_process_is_taken_over_and_says_so(tmp_path, capsys):
    later = subprocess.Popen(["sleep", "30"])  # alive, started after the claim's holder: it got the holder's pid
    try:
        claim = claim_of(tmp_path, pid=later.pid, pid_start=process_start(later.pid) - 1)
        claim.acquire()
    finally:
        later.kill()
    err = capsys.readouterr().err
    assert f"taking over the claim on {tmp_path} of pid {later.pid} on {socket.gethostname()}" in err
    assert err.rstrip().endswith(f": pid {later.pid} is now another process")
    assert json.loads((tmp_path / ".claim").read_text())["pid"] == this_process()["pid"]
    claim.release()


@pytest.mark.parametrize("content, damage", [
    (b"", "empty"),
    (b"\0" * 64, "not a JSON object"),  # zeros: a file system's recovery of a file being written at a crash
    (b'{"host": "node1", "pid": 42', "not a JSON object"),
    (b"[42]", "not a JSON object"),
], ids=["empty", "zeros", "cut short", "a JSON list"])
def test_an_empty_or_damaged_claim_is_taken_over_with_a_warning(tmp_path, capsys, content, damage):
    (tmp_path / ".claim").write_bytes(content)
    claim = Claim(tmp_path / ".claim")
    claim.acquire()
    assert capsys.readouterr().err == (f"warning: taking over the claim on {tmp_path}: {tmp_path}/.claim is {damage}, "
                                       "naming no holder, and its lock was free\n")
    assert json.loads((tmp_path / ".claim").read_text())["pid"] == this_process()["pid"]
    claim.release()
    assert not (tmp_path / ".claim").exists()
    fresh = Claim(tmp_path / ".claim")  # a claim file the start creates itself (empty until written): no warning
    fresh.acquire()
    assert capsys.readouterr().err == ""
    fresh.release()


def test_a_live_process_keeps_its_claim_even_when_the_lock_is_free(tmp_path):
    """A file system whose locks other processes do not see: the claim itself tells the holder is alive."""
    alive = subprocess.Popen(["sleep", "30"])
    try:
        holder = claim_of(tmp_path, pid=alive.pid, pid_start=process_start(alive.pid))
        with pytest.raises(RunDirError, match=f"in use by pid {alive.pid} on .*: one process per run directory; wait "
                                              f"for it to end \\(if it has ended, delete {tmp_path}/.claim\\)"):
            holder.acquire()
    finally:
        alive.kill()


def slurm_job(*command: str) -> str:
    return subprocess.run(["sbatch", "--parsable", "--output=/dev/null", "--wrap", " ".join(command)],
                          capture_output=True, text=True, check=True).stdout.strip().split(";")[0]


@needs_slurm
def test_a_claim_from_another_node_is_kept_while_its_slurm_job_runs_and_taken_once_it_ended(tmp_path, capsys):
    assert cluster_ready(), "CI must start the one-node cluster: bash slurm/local_cluster.sh"
    running = slurm_job("sleep", "60")
    try:
        wait(lambda: state(running).startswith("RUNNING"), 60, "the job to run")
        with pytest.raises(RunDirError, match=f"in use by pid 4242 on node7, Slurm job {running}, since"):
            claim_of(tmp_path, host="node7", pid=4242, slurm_job=running).acquire()
    finally:
        subprocess.run(["scancel", running], check=True)
    wait(lambda: state(running) == "", 60, "the job to end")
    claim = claim_of(tmp_path, host="node7", pid=4242, slurm_job=running)
    claim.acquire()
    assert f"of pid 4242 on node7, Slurm job {running}, since" in (err := capsys.readouterr().err)
    assert err.rstrip().endswith(f"Slurm job {running} has ended")
    claim.release()


def test_torn_and_damaged_rows_are_told_apart_from_whole_ones(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("step,train/loss\n0,10.8\n1,10.7\nx,1\n2,10.6,extra\n3,10.5\n4,10.")
    header, rows, dropped = read_table(path)
    assert header == ["step", "train/loss"] and [r["step"] for r in rows] == ["0", "1", "3"]
    assert dropped == 3  # no integer step, a field too many, the last line cut short


def test_lost_validation_rows_come_back_from_a_checkpoint_of_their_step_else_are_named(prepared, tmp_path):
    """A real run resumed from previous.ckpt (step 4: its last.ckpt lost) whose metrics.csv has the validation rows of
    steps 1 and 3 (the validations after optimizer steps 2 and 4) cut short with their newlines kept (a damaged copy),
    and whose step-0000002.ckpt is lost: both rows are dropped; step 3's is validated again from step-0000004.ckpt,
    the row training logged byte for byte, and step 1's, whose weights no checkpoint holds now, is named. Every other
    row before step 4 is kept byte for byte, and steps 4-5 are logged again."""
    run = tmp_path / "run"
    assert (result := run_cli("normlab-train", f"run_dir={run}", *FAST_TRAIN)).returncode == 0, result.stderr[-3000:]
    for name in ("last.ckpt", "last.ckpt.json", "step-0000002.ckpt", "step-0000002.ckpt.json"):
        (run / "checkpoints" / name).unlink()
    metrics = run / "metrics.csv"
    lines = metrics.read_text().splitlines(keepends=True)
    step_1, step_3 = [i + 1 for i, row in enumerate(read_table(metrics)[1]) if row["val/loss"] and int(row["step"]) < 4]
    kept = [line for i, line in enumerate(lines[1:], 1) if i != step_1 and int(line.split(",")[0]) < 4]
    damaged = [line[: line.rindex(",")] + "\n" if i in (step_1, step_3) else line for i, line in enumerate(lines)]
    metrics.write_text("".join(damaged))  # each cut short: it loses its last field, val/loss

    result = run_cli("normlab-train", f"run_dir={run}", *FAST_TRAIN)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming {run} from checkpoints/previous.ckpt at step 4" in result.stderr
    assert f"warning: {metrics}: dropped 2 torn or damaged rows" in result.stderr
    assert (f"warning: {metrics} has no validation rows for step 1 (lost with the file; they cannot be "
            "regenerated)") in result.stderr
    assert "metrics.csv: validated step 4 again from step-0000004.ckpt" in result.stderr
    after = metrics.read_text().splitlines(keepends=True)
    assert after[: 1 + len(kept)] == [lines[0], *kept]  # step 3's validation row among them, as training logged it
    rows = read_table(metrics)[1]
    assert [r["step"] for r in rows if r["train/loss"]] == ["0", "1", "2", "3", "4", "5"]
    assert [r["step"] for r in rows if r["val/loss"]] == ["3", "5"]  # 1's is lost; 5's logged again


def test_a_finished_run_whose_final_validation_row_was_torn_gets_it_back_bit_for_bit(sweep, tmp_path):
    """A finished run (a copy of the session's LayerNorm run) without its final validation row: the report leaves it
    out and names the command that repairs it. Killed mid-write of that row (its last line cut short), the run gets
    it back from that command, byte for byte the row training logged, validated again from step-0000006.ckpt, with no
    warning that a row cannot be regenerated; the report then compares the run."""
    run = Path(shutil.copytree(run_of(sweep, "layernorm"), tmp_path / "runs" / "ln",
                               ignore=shutil.ignore_patterns("previous.ckpt*")))
    metrics = run / "metrics.csv"
    logged = metrics.read_bytes()
    final = logged[logged.rindex(b"\n", 0, -1) + 1:]  # the validation after step 6
    assert final.startswith(b"5,") and final.rstrip().split(b",")[-1]
    metrics.write_bytes(logged[: -len(final)])
    (before,) = group_runs(find_runs([run.parent])[0], SMOKE)[0].runs  # what normlab-report makes of it
    found = re.fullmatch(r"metrics.csv has no validation of its final step 6, which its checkpoint holds: `([^`]+)` "
                         r"puts it back: left out", before.left_out)
    assert found, before.left_out
    command = shlex.split(found.group(1))
    assert command[0] == "normlab-train" and command[-1] == f"run_dir={run}" and "norm=layernorm" in command

    metrics.write_bytes(logged[: -len(final) // 2])  # the row cut mid-way
    result = run_cli(*command)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{run} is finished (step 6 of 6): nothing to do" in result.stdout
    assert "metrics.csv: validated step 6 again from step-0000006.ckpt" in result.stderr
    assert "cannot be regenerated" not in result.stderr
    assert metrics.read_bytes() == logged
    (after,) = group_runs(find_runs([run.parent])[0], SMOKE)[0].runs
    assert (after.left_out, after.val_step) == ("", 6)


def test_a_run_written_before_classes_and_keys_moved_resumes_from_its_old_command(prepared, tmp_path):
    """A real run whose config.yaml and checkpoints are as normlab wrote them before classes and keys moved (classes
    by their places before the subpackages, `normlab.norms.LayerNorm`...; model.lr; the run directory as the callback
    callbacks.scheduled_checkpoints), its last.ckpt lost: the command of then (model.lr=,
    callbacks.scheduled_checkpoints.*=) resumes it from previous.ckpt at step 4 instead of refusing a run directory
    of another config, and its model loads from those checkpoints."""
    run = tmp_path / "run"
    assert (result := run_cli("normlab-train", f"run_dir={run}", *FAST_TRAIN)).returncode == 0, result.stderr[-3000:]
    for name in ("last.ckpt", "last.ckpt.json"):
        (run / "checkpoints" / name).unlink()
    config = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"))
    OmegaConf.save(OmegaConf.create(written_before(config)), run / "config.yaml")
    for path in (run / "checkpoints").glob("*.ckpt"):  # each with its digest file written anew
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        checkpoint["hyper_parameters"]["config"] = written_before(checkpoint["hyper_parameters"]["config"])
        write_checkpoint(checkpoint, path)
    saved = OmegaConf.load(run / "config.yaml")
    assert saved.callbacks.scheduled_checkpoints._target_ == "normlab.run_dir.RunDirectory" and saved.model.lr == 3e-3
    assert saved.norm.layer._target_.startswith("normlab.norms.") and "checkpoints" not in saved
    load_model(run / "checkpoints" / "step-0000002.ckpt")  # no unknown key model.lr
    old_command = [arg.replace("checkpoints.", "callbacks.scheduled_checkpoints.") for arg in FAST_TRAIN]

    result = run_cli("normlab-train", f"run_dir={run}", *old_command, "model.lr=3e-3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming {run} from checkpoints/previous.ckpt at step 4" in result.stderr
    assert [r["step"] for r in read_table(run / "metrics.csv")[1] if r["train/loss"]] == ["0", "1", "2", "3", "4", "5"]
    saved = OmegaConf.load(run / "config.yaml")  # written as it is now
    assert saved.checkpoints == {"every": 2, "dense_until": 4, "sparse_every": 6, "scheduled": "weights"}
    assert "lr" not in saved.model and "scheduled_checkpoints" not in saved.callbacks and saved.optimizer.lr == 3e-3


def test_the_schedule_always_ends_at_the_final_step():
    assert checkpoint_steps(150, 100, 1000, 1000) == [0, 100, 150]  # the audit's run: its angles were of step 100
    assert checkpoint_steps(200, 100, 1000, 1000) == [0, 100, 200]  # a multiple: nothing added
    paper = checkpoint_steps(25_500, 1000, 10_000, 10_000)
    assert paper == [0, *range(1000, 10_001, 1000), 20_000, 25_500]
    assert checkpoint_steps(6, 4, 4, 100, extra=(5,)) == [0, 4, 5, 6]


# -- a run directory is known by its files (common/run_identity.run_files): resumed, branched into, or refused


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


T = ["model=tiny", "data.batch_size=2", "data.val_tokens=1024", "logger=csv", "trainer.val_check_interval=2",
     "trainer.max_steps=8", "probe.tokens=8192"]


def one_line(result) -> str:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    return line


def test_a_run_whose_checkpoints_were_deleted_is_refused_never_replaced(sweep, tmp_path):
    """Its config.yaml, metrics.csv and angles.csv left, the checkpoints deleted to save quota: a start of another
    norm, of the same config, or a branch into it all leave every byte as it was; restart=true moves it aside and
    says what it moved."""
    run = Path(shutil.copytree(run_of(sweep, "rmsnorm"), tmp_path / "x"))
    shutil.rmtree(run / "checkpoints")
    before = files_of(run)
    other = one_line(run_cli("normlab-train", f"run_dir={run}", *FAST_TRAIN, "norm=layernorm"))
    assert other == (f"normlab-train: error: {run} holds a run of another config (norm.layer._target_: "
                     "normlab.model.norms.RMSNorm -> normlab.model.norms.LayerNorm, norm.layer.bias: False -> True, "
                     "norm.name: rmsnorm -> layernorm): give another run_dir, or restart=true to move that run "
                     "aside and start over")
    same = one_line(run_cli("normlab-train", f"run_dir={run}", *FAST_TRAIN, "norm=rmsnorm"))
    assert same == (f"normlab-train: error: {run} holds a run whose checkpoints are gone (run_id, config.yaml, "
                    "metrics.csv, angles.csv; rows in metrics.csv and angles.csv), which a start here would replace: "
                    "give another run_dir, or restart=true to move that run aside and start over")
    branch = one_line(run_cli("normlab-train", f"run_dir={run}", *FAST_TRAIN, "norm=rmsnorm",
                              f"branch.source={run_of(sweep, 'rmsnorm')}", "branch.step=4"))
    assert "which a start here would replace" in branch or "holds a run of another config" in branch
    assert files_of(run) == before

    restarted = run_cli("normlab-train", f"run_dir={run}", *FAST_TRAIN, "norm=rmsnorm", "restart=true")
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    (aside,) = tmp_path.glob("x.replaced-*")
    assert files_of(aside) == before
    assert (f"restart=true: moved the earlier run (angles.csv, config.yaml, metrics.csv, overrides.yaml, run_id) to "
            f"{aside}") in restarted.stderr


def test_a_start_that_saved_no_checkpoint_starts_again_in_its_directory(sweep, tmp_path):
    """What a start writes before its first checkpoint (run_id, config.yaml, overrides.yaml), and no row: the same
    command starts again there, with the run's id kept."""
    run = Path(shutil.copytree(run_of(sweep, "layernorm"), tmp_path / "x"))
    for name in ("checkpoints", "metrics.csv", "angles.csv"):
        shutil.rmtree(run / name) if (run / name).is_dir() else (run / name).unlink()
    run_id = (run / "run_id").read_text()
    result = run_cli("normlab-train", f"run_dir={run}", *FAST_TRAIN, "norm=layernorm")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run / "run_id").read_text() == run_id and (run / "checkpoints" / "step-0000006.ckpt").is_file()


@pytest.mark.parametrize("where", ["the corpus", "inside the corpus", "inside a run"])
def test_a_run_dir_in_a_corpus_or_inside_another_run_is_refused(prepared, sweep, tmp_path, where):
    corpus = Path(shutil.copytree(prepared, tmp_path / "corpus"))
    run_dir = {"the corpus": corpus, "inside the corpus": corpus / "run",
               "inside a run": run_of(sweep, "layernorm") / "checkpoints" / "sub"}[where]
    before = files_of(corpus)
    line = one_line(run_cli("normlab-train", f"run_dir={run_dir}", *T))
    expected = {"the corpus": f"run_dir={corpus} is a prepared corpus: give a run directory of its own, e.g. "
                              "run_dir=checkpoints/myrun",
                "inside the corpus": f"run_dir={run_dir} lies inside a prepared corpus, {corpus}: give a run "
                                     "directory outside it",
                "inside a run": f"run_dir={run_dir} lies inside a run directory, {run_of(sweep, 'layernorm')}: give "
                                "a run directory outside it"}[where]
    assert line == f"normlab-train: error: {expected}"
    assert files_of(corpus) == before and not (run_of(sweep, "layernorm") / "checkpoints" / "sub").exists()
