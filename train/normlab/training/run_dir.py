"""The run directory and everything that makes its progress durable: one owner, in the spirit of torchtitan's
CheckpointManager. `RunDirectory` (a Lightning callback, `callbacks.scheduled_checkpoints` in the config)

- claims the directory for one process before anything is written (`.claim`: host, pid, Slurm job; a stale claim
  of a dead process or an ended job is taken over with a warning), and releases it at the end;
- checks that the directory holds a run of the same config (or moves that run aside with restart=true), and keeps
  the run's wandb id (`run_id`: new for a fresh run, the same whenever it resumes);
- writes every checkpoint atomically (temporary file, fsync, rename) with a digest file beside it
  (`<name>.ckpt.json`: sha256, size, step, contents) that is checked before a checkpoint is resumed from or
  analysed: `last.ckpt` (full training state) after every validation, the previous one kept as `previous.ckpt`,
  and the scheduled `step-NNNNNNN.ckpt` (model weights and config; full state with scheduled=full);
- resumes from the intact full checkpoint of the highest step (the step recorded in it, not file times);
- makes metrics.csv and angles.csv consistent with that checkpoint (torn rows and rows after it dropped, gaps
  reported) and flushes them to disk before every checkpoint, so a checkpoint never runs ahead of its rows;
- saves and restores every rank's random generators (dropout) in the full checkpoints.
"""

import csv
import errno
import fcntl
import hashlib
import io
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Checkpoint
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from normlab.common.errors import ConfigError, NormlabError, process_rank
from normlab.common.outputs import replace_file
from normlab.common.paths import RUN_ID_FILE, identifies_the_run

CLAIM_FILE = ".claim"
METRICS_FILE = "metrics.csv"
ANGLES_FILE = "angles.csv"
LAST, PREVIOUS = "last.ckpt", "previous.ckpt"
VERIFY_PROGRESS_BYTES = 1 << 30  # show a progress bar when verifying checkpoints larger than this
RANK_WAIT_SECONDS = 600  # how long ranks other than 0 wait for rank 0 to claim the directory


class RunDirError(NormlabError):
    """The run directory cannot be used as asked (in use, damaged beyond resuming, disk full...)."""


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def checkpoint_steps(max_steps: int, every: int, dense_until: int, sparse_every: int, extra=()) -> list[int]:
    """Step 0, every `every` steps up to `dense_until`, then every `sparse_every` steps up to max_steps
    (the paper: 1K..10K every 1K, then every 10K), plus any `extra` steps."""
    steps = {0, *extra, *range(every, min(dense_until, max_steps) + 1, every)}
    steps.update(range(sparse_every * (dense_until // sparse_every + 1), max_steps + 1, sparse_every))
    return sorted(s for s in steps if 0 <= s <= max_steps)


# -- durable files


def fsync_file(path: Path) -> None:
    if path.is_file():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomically(path: Path, data: bytes) -> None:
    """`path` holds either its old content or `data`, whatever happens (outputs.replace_file)."""
    try:
        replace_file(path, data)
    except OSError as e:
        raise write_error(path, e) from None


def write_error(path: Path, e: OSError) -> RunDirError:
    if e.errno == errno.ENOSPC:
        free = shutil.disk_usage(path.parent).free
        return RunDirError(f"no space left on device while writing {path} ({free / 2**20:,.0f} MB free there): free "
                           "space on that file system, or give another run_dir; the earlier files are intact")
    return RunDirError(f"cannot write {path} ({e.strerror}): check the permissions and the file system of run_dir")


# -- CSV tables (metrics.csv, angles.csv): rows appended by one writer, torn rows told apart from whole ones


def read_table(path: Path) -> tuple[list[str], list[dict], int]:
    """(header, whole rows, rows dropped) of a CSV file. A row is dropped when it is torn (the file's last line
    without its newline: a write cut short), has another number of fields than the header, or has no integer step."""
    if not path.is_file():
        return [], [], 0
    text = path.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    torn = lines.pop() != ""  # after the last newline: empty, unless the last row was cut short
    if not lines:
        return [], [], int(torn)
    header = next(csv.reader([lines[0]]))
    rows, dropped = [], int(torn)
    for fields in csv.reader(lines[1:]):
        row = dict(zip(header, fields))
        if len(fields) != len(header) or not row.get("step", "").isdigit():
            dropped += 1
            continue
        rows.append(row)
    return header, rows, dropped


def write_table(path: Path, header: list[str], rows: list[dict]) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=header, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomically(path, buffer.getvalue().encode())


def step_ranges(steps: list[int]) -> str:
    """'3, 7-9' for [3, 7, 8, 9]."""
    parts, start = [], None
    for i, step in enumerate(steps):
        start = step if start is None else start
        if i + 1 == len(steps) or steps[i + 1] != step + 1:
            parts.append(f"{start}" if start == step else f"{start}-{step}")
            start = None
    return ", ".join(parts)


# -- checkpoints: atomic, with a digest file; verified before use


@dataclass(frozen=True)
class Record:
    """What the digest file `<checkpoint>.json` says of its checkpoint."""
    sha256: str
    bytes: int
    step: int
    contents: str  # "full" (training state) or "weights" (model weights and config)


def digest_path(path: Path) -> Path:
    return path.with_name(f"{path.name}.json")


class HashingWriter:
    """A binary file that hashes what is written to it (torch.save writes its archive front to back). It keeps the
    OSError of a failed write: torch.save reports it as a RuntimeError about the archive's position."""

    def __init__(self, file):
        self.file, self.sha256, self.error = file, hashlib.sha256(), None

    def write(self, data) -> int:
        self.sha256.update(data)
        try:
            return self.file.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.file.flush()


def write_checkpoint(checkpoint: dict, path: Path) -> Record:
    """torch.save `checkpoint` to `path` atomically, then its digest file beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, writer = path.with_name(f".{path.name}.tmp"), None
    try:
        with open(tmp, "wb") as f:
            writer = HashingWriter(f)
            torch.save(checkpoint, writer)
            f.flush()
            os.fsync(f.fileno())
        record = Record(writer.sha256.hexdigest(), tmp.stat().st_size, checkpoint["global_step"],
                        "full" if "optimizer_states" in checkpoint else "weights")
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        error = writer.error if writer and writer.error else e
        if not isinstance(error, OSError):
            raise
        raise write_error(path, error) from None
    write_atomically(digest_path(path), (json.dumps(record.__dict__) + "\n").encode())
    return record


def verify(path: Path) -> Record:
    """The record of an intact checkpoint; raises RunDirError saying what is wrong with a damaged one."""
    try:
        record = Record(**json.loads(digest_path(path).read_text()))
    except FileNotFoundError:
        raise RunDirError(f"{path} has no digest file {digest_path(path).name} (a save cut short, or a checkpoint "
                          "not written by normlab)") from None
    except (ValueError, TypeError):
        raise RunDirError(f"{path}: its digest file {digest_path(path).name} is damaged") from None
    try:
        size = path.stat().st_size
        if size != record.bytes:
            raise RunDirError(f"{path} holds {size:,} bytes, its digest file says {record.bytes:,} "
                              "(truncated or replaced)")
        sha256 = hashlib.sha256()
        with (
            open(path, "rb") as f,
            tqdm(
                total=size,
                unit="B",
                unit_scale=True,
                desc=f"verifying {path.name}",
                disable=size < VERIFY_PROGRESS_BYTES,
            ) as progress,
        ):
            while chunk := f.read(1 << 24):
                sha256.update(chunk)
                progress.update(len(chunk))
    except OSError as e:
        raise RunDirError(f"cannot read {path} ({e.strerror})") from None
    if sha256.hexdigest() != record.sha256:
        raise RunDirError(f"{path} does not match the sha256 in its digest file (its bytes were corrupted)")
    return record


def recorded_step(path: Path) -> int:
    """The step a checkpoint's digest file records (-1 when it cannot be read: verify says what is wrong)."""
    try:
        return int(json.loads(digest_path(path).read_text())["step"])
    except (OSError, ValueError, TypeError, KeyError):
        return -1


def newest_intact(paths: list[Path]) -> tuple[Path | None, Record | None, list[tuple[Path, str]]]:
    """Of the checkpoints `paths`, the intact one of the highest recorded step (at equal steps, the first given),
    verified from the newest down, with its record; and each damaged one passed on the way, with what is wrong."""
    damaged = []
    for path in sorted(paths, key=recorded_step, reverse=True):  # a stable sort: ties keep the order given
        try:
            return path, verify(path), damaged
        except RunDirError as e:
            damaged.append((path, str(e)))
    return None, None, damaged


def newest_checkpoint(run: Path, accepts: str) -> tuple[Path, int, list[str]]:
    """The newest intact checkpoint of a run directory (a scheduled one, last.ckpt or previous.ckpt) by the step its
    digest file records, with that step and a warning for each damaged one passed on the way. `accepts`: what the
    command takes instead, for the error when the directory holds no checkpoint."""
    folder = run / "checkpoints"
    # at equal steps a scheduled checkpoint (weights only) before last.ckpt: fewer bytes to hash
    candidates = sorted(folder.glob("step-*.ckpt")) + [p for p in (folder / LAST, folder / PREVIOUS) if p.is_file()]
    if not candidates:
        raise RunDirError(f"no checkpoint at {run} (neither a .ckpt nor a run directory with checkpoints/*.ckpt): "
                          f"give {accepts}")
    path, record, passed = newest_intact(candidates)
    damaged = [reason for _, reason in passed]
    if path is None:
        more = f" (and {len(damaged) - 1} more damaged)" if len(damaged) > 1 else ""
        raise RunDirError(f"no intact checkpoint in {folder}: {damaged[0]}{more}; restore them from a copy, or train "
                          "the run again")
    return path, record.step, [f"{reason}: skipped" for reason in damaged]


def chosen_checkpoint(path: Path, accepts: str) -> tuple[Path, int, list[str]]:
    """What a command given `path` reads: a .ckpt verified against its digest file, or a run directory's newest
    intact checkpoint (newest_checkpoint); with its step and the warnings to print."""
    if path.is_dir():
        return newest_checkpoint(path, accepts)
    try:
        return path, verify(path).step, []
    except RunDirError as e:
        raise RunDirError(f"{e}: give another checkpoint of the run, or the run directory") from None


class VerifiedCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO (rank 0 writes) through write_checkpoint. While `deferred`, a failed write is kept
    in `error` rather than raised, so that RunDirectory.save can stop every rank together instead of leaving the
    others waiting at the barrier that follows a save."""

    def __init__(self):
        self.deferred, self.error = False, None

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        try:
            write_checkpoint(checkpoint, Path(path))
        except RunDirError as e:
            if not self.deferred:
                raise
            self.error = e


# -- the claim: one process per run directory


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


# -- the run directory


def flat(config, prefix: str = "") -> dict:
    items = {}
    for key, value in config.items():
        if isinstance(value, dict):
            items.update(flat(value, f"{prefix}{key}."))
        else:
            items[f"{prefix}{key}"] = value
    return items


def rng_states() -> dict:
    """This process's random number generators: what dropout draws from (the data order does not). Only
    tensors and numbers, so that checkpoints load with torch.load(weights_only=True)."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "numpy": (torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


class RunDirectory(Checkpoint):
    """The owner of a run directory (see the module's docstring). train() opens it before the Trainer exists and
    closes it at the end; the other callbacks find it with RunDirectory.of(trainer)."""

    def __init__(
        self,
        path: str,
        every: int,
        dense_until: int,
        sparse_every: int,
        max_steps: int,
        val_check_interval: int,
        extra_steps=(),
        scheduled: str = "weights",
    ):
        for name, value in (("every", every), ("dense_until", dense_until), ("sparse_every", sparse_every)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"callbacks.scheduled_checkpoints.{name}={value}: give a positive number of steps")
        if scheduled not in ("weights", "full"):
            raise ConfigError(f"callbacks.scheduled_checkpoints.scheduled={scheduled}: choose weights or full")
        if not str(path).strip():
            raise ConfigError("run_dir is empty: give the run's directory, e.g. run_dir=checkpoints/myrun")
        self.path = Path(path)
        self.dir = self.path / "checkpoints"
        self.steps = set(checkpoint_steps(max_steps, every, dense_until, sparse_every, extra_steps))
        off = sorted(s for s in self.steps | {max_steps} if s % val_check_interval)
        if off:
            raise ConfigError(
                f"checkpoint step {off[0]} is not a validation step (trainer.val_check_interval="
                f"{val_check_interval}): make trainer.max_steps and the callbacks.scheduled_checkpoints "
                "steps multiples of it"
            )
        self.scheduled_contents, self.val_check_interval, self.max_steps = scheduled, val_check_interval, max_steps
        self.claim = Claim(self.path / CLAIM_FILE)
        self.io = VerifiedCheckpointIO()
        self.resume_path: Path | None = None
        self.resume_step = 0
        self.damaged: set[str] = set()  # names of checkpoints found damaged: never promoted to previous.ckpt
        self.last_good: Path | None = None  # the newest checkpoint this process verified or wrote
        self.last_saved, self.last_saved_step = None, None  # the last full checkpoint this process wrote, its step

    @staticmethod
    def of(trainer: L.Trainer) -> "RunDirectory | None":
        return next((c for c in trainer.callbacks if isinstance(c, RunDirectory)), None)

    def scheduled_path(self, step: int) -> Path:
        return self.dir / f"step-{step:07d}.ckpt"

    # -- start and end

    @contextmanager
    def opened(self, cfg: DictConfig, overrides: list[str]):
        """Claim the directory and prepare it for the run (rank 0), or wait for rank 0 to have done so (other
        ranks); set resume_path and resume_step. Release the claim at the end; a directory that got nothing
        but the claim is removed."""
        existed = self.path.is_dir() and any(self.path.iterdir())
        try:
            if process_rank() == 0:
                self.path.mkdir(parents=True, exist_ok=True)
                self.claim.acquire()
                self.prepare(cfg, overrides)
            else:
                chosen = self.claim.join()["resume"]
                self.resume_path = self.path / chosen["path"] if chosen["path"] else None
                self.resume_step = chosen["step"]
            yield self
        finally:
            devices = cfg.trainer.devices if isinstance(cfg.trainer.devices, int) else 2  # "auto": maybe several
            several_ranks = devices * cfg.trainer.num_nodes > 1
            self.claim.release(for_other_ranks=several_ranks and self.resume_step >= self.max_steps)
            if not existed and self.path.is_dir() and not any(self.path.iterdir()):
                self.path.rmdir()

    def prepare(self, cfg: DictConfig, overrides: list[str]) -> None:
        if cfg.restart:
            self.move_aside()
        else:
            self.check_config(cfg)
        self.choose_resume()
        if self.resume_path is not None:
            print(
                f"resuming {self.path} from {self.resume_path.relative_to(self.path)} at step {self.resume_step}",
                file=sys.stderr,
                flush=True,
            )
        self.reconcile_metrics()
        self.keep_angles_until(self.resume_step)
        if not (self.path / RUN_ID_FILE).is_file():
            write_atomically(self.path / RUN_ID_FILE, (os.urandom(8).hex() + "\n").encode())
        config = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
        write_atomically(self.path / "config.yaml", OmegaConf.to_yaml(config, resolve=True).encode())
        write_atomically(self.path / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(overrides)).encode())
        chosen = str(self.resume_path.relative_to(self.path)) if self.resume_path else None
        self.claim.update({**this_process(), "resume": {"path": chosen, "step": self.resume_step}})

    def check_config(self, cfg: DictConfig) -> None:
        """Refuse a run directory holding checkpoints of another config (what only names, places, logs or speeds
        up a run may differ: paths.NOT_IDENTITY)."""
        if not any(self.dir.glob("*.ckpt")):
            return
        saved = self.path / "config.yaml"
        if not saved.is_file():
            raise RunDirError(
                f"{self.path} holds checkpoints but no config.yaml to check them against: give another "
                "run_dir, or restart=true to move that run aside and start over"
            )
        try:
            old = flat(OmegaConf.to_container(OmegaConf.load(saved), resolve=True))
        except Exception as e:  # yaml and OmegaConf errors alike
            raise RunDirError(
                f"{saved} is damaged ({type(e).__name__}: {str(e).splitlines()[0]}): restore it, or "
                "restart=true to move that run aside and start over"
            ) from None
        new = flat(OmegaConf.to_container(cfg, resolve=True))
        for config in (old, new):  # where it runs may change, not how many sequences an optimizer step sees
            devices = [
                config.get(k) if isinstance(config.get(k), int) else 1
                for k in ("trainer.devices", "trainer.num_nodes")
            ]
            per_step = config.get("data.batch_size", 0) * devices[0] * devices[1]
            config["sequences per optimizer step"] = config.get("global_batch_size") or per_step
        # a run directory that was moved keeps its identity: paths inside it follow it
        old = {
            k: v.replace(old.get("run_dir", "\0"), new["run_dir"]) if isinstance(v, str) else v for k, v in old.items()
        }
        changed = [
            k
            for k in sorted(old.keys() | new.keys(), key=lambda k: (k.startswith("callbacks."), k))
            if identifies_the_run(k) and old.get(k) != new.get(k)
        ]  # callbacks last: mostly copies
        if changed:
            shown = ", ".join(f"{k}: {old.get(k)} -> {new.get(k)}" for k in changed[:3]) + (
                " ..." if len(changed) > 3 else ""
            )
            raise RunDirError(
                f"{self.path} holds checkpoints of another config ({shown}): give another run_dir, "
                "or restart=true to move that run aside and start over"
            )

    def move_aside(self) -> None:
        """restart=true: move what the directory holds to <run_dir>.replaced-<time> (nothing is deleted); the new
        run gets a new wandb id."""
        entries = [p for p in self.path.iterdir() if p.name != CLAIM_FILE]
        if entries:
            aside = self.path.with_name(f"{self.path.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
            aside.mkdir()
            for entry in entries:
                entry.rename(aside / entry.name)
            print(f"restart=true: moved the earlier run to {aside}", file=sys.stderr)

    def choose_resume(self) -> None:
        """The intact full checkpoint of the highest step recorded in it; damaged ones are reported and skipped (they
        are rewritten when the run passes their step again). No full checkpoint at all: a fresh start, unless the
        run had got further (then its progress would be lost: refused)."""
        for partial in [*self.dir.glob(".*.tmp"), *self.path.glob(".*.tmp")]:
            warn(f"removing {partial}, left by a save that was cut short")
            partial.unlink(missing_ok=True)
        candidates = []
        for path in self.dir.glob("*.ckpt"):
            try:
                full = json.loads(digest_path(path).read_text())["contents"] == "full"
            except (OSError, ValueError, KeyError, TypeError):
                full = path.name in (LAST, PREVIOUS)  # checked (and reported) by newest_intact
            if full and not path.name.startswith("nonfinite"):
                candidates.append(path)
        candidates.sort(key=lambda p: p.name != LAST)  # at equal steps: last.ckpt first
        path, record, passed = newest_intact(candidates)
        self.damaged.update(p.name for p, _ in passed)
        damaged = [reason for _, reason in passed]
        if path is not None:
            for reason in damaged:
                warn(f"{reason}: not resumed from; it is rewritten when the run passes its step again")
            self.resume_path, self.resume_step, self.last_good = path, record.step, path
            return
        progressed = sorted(p.name for p in self.dir.glob("step-*.ckpt") if p.name != "step-0000000.ckpt")
        if damaged or progressed:
            more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
            why = f"{damaged[0]}{more}" if damaged else f"it has {progressed[-1]} but no last.ckpt"
            raise RunDirError(
                f"{self.path} has no intact full checkpoint to resume from: {why}; restart=true moves "
                "this run aside and starts over"
            )

    # -- metrics.csv and angles.csv

    def reconcile_metrics(self) -> None:
        """metrics.csv holds exactly the rows of the steps before the resume step: torn rows and the rows an
        interrupted attempt logged after its checkpoint are dropped; training and validation rows missing before it
        are reported."""
        path = self.path / METRICS_FILE
        header, rows, torn = read_table(path)
        if not header:
            return
        kept = [r for r in rows if int(r["step"]) < self.resume_step]
        if torn:
            warn(f"{path}: dropped {torn} torn or damaged row{'s' * (torn > 1)}")
        if len(kept) != len(rows) or torn:
            write_table(path, header, kept)
        if "train/loss" not in header:
            return
        # the validation after optimizer step s (1-based) is logged with the step of that optimizer step's row, s - 1
        validated = {s - 1 for s in range(1, self.resume_step + 1) if self.validates_after(s)}
        gaps = []
        for kind, column, steps in (("training", "train/loss", range(self.resume_step)),
                                    ("validation", "val/loss", validated)):
            missing = sorted(set(steps) - {int(r["step"]) for r in kept if r.get(column)})
            if missing:
                gaps.append(f"{kind} rows for step{'s' * (len(missing) > 1)} {step_ranges(missing)}")
        if gaps:
            warn(f"{path} has no {' and no '.join(gaps)} (lost with the file; they cannot be regenerated)")

    def keep_angles_until(self, step: int) -> None:
        path = self.path / ANGLES_FILE
        header, rows, torn = read_table(path)
        kept = [r for r in rows if int(r["step"]) <= step]
        if torn:
            warn(f"{path}: dropped {torn} torn or damaged row{'s' * (torn > 1)} (their step is measured again)")
        if header and (torn or len(kept) != len(rows)):
            write_table(path, header, kept)

    def angle_rows_per_step(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for row in read_table(self.path / ANGLES_FILE)[1]:
            counts[int(row["step"])] = counts.get(int(row["step"]), 0) + 1
        return counts

    def write_angles(self, records: list[dict], columns: list[str]) -> None:
        """Put the rows of one step into angles.csv (replacing any of that step), in step order; atomic."""
        path = self.path / ANGLES_FILE
        step = records[0]["step"]
        _, rows, _ = read_table(path)
        rows = [r for r in rows if int(r["step"]) != step] + records
        write_table(path, columns, sorted(rows, key=lambda r: int(r["step"])))

    # -- saving

    def sync_tables(self) -> None:
        """metrics.csv to disk (angles.csv is always written atomically)."""
        fsync_file(self.path / METRICS_FILE)

    def save(self, trainer: L.Trainer, path: Path, weights_only: bool) -> None:
        """Save a checkpoint (every rank calls this; rank 0 writes). The rows logged so far reach the disk first. A
        failed write stops every rank with its one-line reason."""
        if trainer.is_global_zero:
            self.sync_tables()
        self.io.deferred, self.io.error = True, None
        try:
            trainer.save_checkpoint(path, weights_only=weights_only)
        finally:
            self.io.deferred = False
        if trainer.strategy.reduce_boolean_decision(self.io.error is not None, all=False):
            raise self.io.error or RunDirError(f"rank 0 could not write {path}: see its error")
        self.damaged.discard(path.name)
        self.last_good = path

    def save_last(self, trainer: L.Trainer) -> Path:
        """last.ckpt, keeping the one it replaces as previous.ckpt (hard links: at every moment both exist)."""
        last, previous = self.dir / LAST, self.dir / PREVIOUS
        if trainer.is_global_zero and last.is_file() and LAST not in self.damaged:
            try:
                tmp = previous.with_name(f".{PREVIOUS}.tmp")
                tmp.unlink(missing_ok=True)
                os.link(last, tmp)
                os.replace(tmp, previous)
            except OSError:  # a file system without hard links
                os.replace(last, previous)
            if digest_path(last).is_file():
                write_atomically(digest_path(previous), digest_path(last).read_bytes())
            self.damaged.discard(PREVIOUS)
        self.save(trainer, last, weights_only=False)
        self.last_saved, self.last_saved_step = last, trainer.global_step
        return last

    def on_train_start(self, trainer, pl_module):
        if trainer.global_step == 0 and 0 in self.steps:
            self.save(trainer, self.scheduled_path(0), weights_only=self.scheduled_contents == "weights")

    def validates_after(self, step: int) -> bool:
        """Whether optimizer step `step` (1-based: trainer.global_step once it is done) is followed by a validation."""
        return step % self.val_check_interval == 0 or step == self.max_steps

    def save_step(self, trainer: L.Trainer) -> Path:
        """What is saved after a validation: the scheduled checkpoint of the step (also when one exists: passing a
        step again rewrites a damaged checkpoint of it), then last.ckpt."""
        step = trainer.global_step
        if step in self.steps:
            self.save(trainer, self.scheduled_path(step), weights_only=self.scheduled_contents == "weights")
        return self.save_last(trainer)

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.save_step(trainer)

    # every rank's random generators, in the full checkpoints (Lightning keeps none)
    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        states = rng_states()
        if dist.is_available() and dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, states)
            checkpoint["rng_states"] = gathered
        else:
            checkpoint["rng_states"] = [states]

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        states = checkpoint.get("rng_states", [])
        if len(states) == trainer.world_size:
            set_rng_states(states[trainer.global_rank])
        elif states and trainer.is_global_zero:
            warn(
                f"the checkpoint holds random states of {len(states)} processes, this run has "
                f"{trainer.world_size}: dropout masks will differ from the original run"
            )
