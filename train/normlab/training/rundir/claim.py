"""The claim on a run directory (`<run_dir>/.claim`): one process per run directory. Rank 0 takes it with an
exclusive lock (flock) before anything is written, naming its process (host, pid and its start time, Slurm job and
restart, torchrun run); a claim whose holder is gone (a dead process, an ended or requeued Slurm job) is taken over
with a warning, a live one never. The other ranks of the same launch join it and read what rank 0 chose to resume
from."""

import fcntl
import json
import os
import socket
import subprocess
import time
from pathlib import Path

from normlab.common.errors import process_rank
from normlab.training.rundir.files import RunDirError, warn

CLAIM_FILE = ".claim"
RANK_WAIT_SECONDS = 600  # how long ranks other than 0 wait for rank 0 to claim the directory


def process_start(pid: int) -> int | None:
    """When the process started (clock ticks since boot): with the pid, it tells a process from a later one that
    got the same pid."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def this_process() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": process_start(os.getpid()),
        "ppid": os.getppid(),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", 0)),
        "torchelastic_run": os.environ.get("TORCHELASTIC_RUN_ID"),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def describe(holder: dict) -> str:
    if "pid" not in holder:  # locked by a start that has not written its name yet
        return "another start that is just claiming it"
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, since {holder.get('since')}"


def slurm_job_state(job: str) -> str | None:
    """The job's state ('' once Slurm has forgotten it), or None where Slurm cannot be asked."""
    try:
        result = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode == 0:
        return result.stdout.strip()
    return "" if "Invalid job id" in result.stderr else None


def stale(holder: dict, me: dict) -> str | None:
    """Why the holder of a claim is gone (the claim's lock was free), or None if it may still be running."""
    pid = holder.get("pid", -1)
    if holder.get("host") == me["host"]:
        start = process_start(pid)
        if start is None:
            return f"pid {pid} is no longer running"
        if holder.get("pid_start") not in (None, start):  # a later process got its pid
            return f"pid {pid} is now another process"
        return None
    job = holder.get("slurm_job")
    if job and job == me["slurm_job"] and holder.get("slurm_restart", 0) < me["slurm_restart"]:
        return f"Slurm requeued job {job}"
    if (
        job
        and (state := slurm_job_state(job)) is not None
        and state not in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING")
    ):
        return f"Slurm job {job} has ended"
    return None


def same_launch(holder: dict, me: dict) -> bool:
    """Whether the claim was taken by rank 0 of this process's own launch (srun, torchrun or Lightning's launcher)."""
    if me["slurm_job"] and (holder.get("slurm_job"), holder.get("slurm_restart")) == (
        me["slurm_job"],
        me["slurm_restart"],
    ):
        return True
    if me["torchelastic_run"] not in (None, "", "none") and holder.get("torchelastic_run") == me["torchelastic_run"]:
        return True
    return (
        holder.get("host") == me["host"] and me["ppid"] != 1 and me["ppid"] in (holder.get("pid"), holder.get("ppid"))
    )


def claim_record(text: str) -> dict | None:
    """The record of a claim file's text; None when it holds none (empty, not JSON, or JSON that is not an object)."""
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def training_holder(run_dir: Path) -> dict | None:
    """The process that holds the claim on `run_dir` and may still be training it, or None. Read only: it never
    takes the claim's lock, so that a start of the run is never turned away by someone reading it."""
    holder = Claim(run_dir / CLAIM_FILE).read()
    if not holder or holder.get("released") or stale(holder, this_process()) is not None:
        return None
    return holder


class Claim:
    """`<run_dir>/.claim`: who uses the run directory, held with an exclusive lock (flock) while the holder lives,
    and, once rank 0 has chosen it, the checkpoint every rank resumes from."""

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def read(self) -> dict:
        try:
            return claim_record(self.path.read_text(errors="replace")) or {}
        except OSError:
            return {}

    def acquire(self) -> None:
        me = this_process()
        while True:
            try:  # a claim file this start creates is empty until written: not to be taken for a damaged one
                fd, created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                try:
                    fd, created = os.open(self.path, os.O_RDWR), False
                except FileNotFoundError:  # released (deleted) since: try again
                    continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirError(
                    f"{self.path.parent} is in use by {describe(self.read())}: one process per run "
                    "directory; wait for it to end, or stop it first"
                ) from None
            try:
                if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                    raise FileNotFoundError  # released (deleted) between our open and our lock: try again
            except FileNotFoundError:
                os.close(fd)
                continue
            text = self.path.read_text(errors="replace")
            holder = claim_record(text)
            if holder is None and not created:
                damage = "not a JSON object" if text.strip() else "empty"
                warn(f"taking over the claim on {self.path.parent}: {self.path} is {damage}, naming no holder, and "
                     "its lock was free")
            elif holder and not holder.get("released"):
                if (reason := stale(holder, me)) is None:
                    os.close(fd)
                    raise RunDirError(
                        f"{self.path.parent} is in use by {describe(holder)}: one process per run "
                        f"directory; wait for it to end (if it has ended, delete {self.path})"
                    )
                warn(f"taking over the claim on {self.path.parent} of {describe(holder)}: {reason}")
            self.fd = fd
            self.update(me)
            return

    def update(self, record: dict) -> None:
        # Rewritten in place, not replaced (common/atomic.py): the lock belongs to this open file, which a new file
        # would not hold; a torn record reads as none (claim_record), and the lock still tells whether it is held
        data = json.dumps(record).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)

    def release(self, for_other_ranks: bool = False) -> None:
        """Unlock and delete the claim; with for_other_ranks, keep its record (marked released) for the ranks of this
        launch that may not have read it yet: rank 0 of a finished run exits at once, before they look."""
        if self.fd is not None:
            if for_other_ranks:
                self.update({**self.read(), "released": True})
            else:
                self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None

    def join(self, timeout: float = RANK_WAIT_SECONDS) -> dict:
        """For ranks other than 0: wait until rank 0 of this launch holds the claim and has chosen what to resume
        from; return its record."""
        me, deadline = this_process(), time.monotonic() + timeout
        while True:
            holder = self.read()
            if "resume" in holder and same_launch(holder, me):
                return holder
            if time.monotonic() > deadline:
                held = f"it is held by {describe(holder)}" if holder else "nobody claimed it"
                raise RunDirError(
                    f"rank {process_rank()} waited {timeout:.0f} s for rank 0 to claim "
                    f"{self.path.parent}, but {held}: one process per run directory"
                )
            time.sleep(0.5)
