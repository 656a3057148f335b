"""A run directory's checkpoint files: which steps get a scheduled one (checkpoint_steps); each written atomically
with a digest file beside it (`<name>.ckpt.json`: sha256, size, step, contents) and verified against it before it is
resumed from or read; the newest intact one chosen by the step its digest file records (not file times). Lightning
stays out of this module: the commands that only read a checkpoint import it (RunDirectory's checkpoint IO plugin,
which writes through write_checkpoint, is in directory.py)."""

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from normlab.common.atomic import replacing
from normlab.common.errors import ConfigError
from normlab.training.rundir.files import RunDirError, warn, write_atomically, write_error

LAST, PREVIOUS = "last.ckpt", "previous.ckpt"
VERIFY_PROGRESS_BYTES = 1 << 30  # show a progress bar when verifying checkpoints larger than this


def checkpoint_steps(max_steps: int, every: int, dense_until: int, sparse_every: int, extra=()) -> list[int]:
    """Step 0, every `every` steps up to `dense_until`, then every `sparse_every` steps up to max_steps
    (the paper: 1K..10K every 1K, then every 10K), plus any `extra` steps, and max_steps itself whatever the
    intervals: the final weights always get a scheduled checkpoint and angle rows (max_steps=150 with every=100:
    0, 100, 150), so that a run's last loss and its last angles are of the same step."""
    steps = {0, max_steps, *extra, *range(every, min(dense_until, max_steps) + 1, every)}
    steps.update(range(sparse_every * (dense_until // sparse_every + 1), max_steps + 1, sparse_every))
    return sorted(s for s in steps if 0 <= s <= max_steps)


class CheckpointSchedule:
    """Which checkpoints a run saves in `folder`, after the validation that follows an optimizer step: the scheduled
    `step-NNNNNNN.ckpt` of checkpoint_steps, the final step among them (model weights and config, or the full state
    with scheduled="full"), and last.ckpt after every validation. The arguments after val_check_interval are the
    settings of `checkpoints` in the config (training/checks.py checks its keys against them)."""

    def __init__(self, folder: Path, max_steps: int, val_check_interval: int, every: int, dense_until: int,
                 sparse_every: int, scheduled: str = "weights", extra_steps=()):
        for name, value in (("every", every), ("dense_until", dense_until), ("sparse_every", sparse_every)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"checkpoints.{name}={value}: give a positive number of steps")
        if scheduled not in ("weights", "full"):
            raise ConfigError(f"checkpoints.scheduled={scheduled}: choose weights or full")
        self.steps = set(checkpoint_steps(max_steps, every, dense_until, sparse_every, extra_steps))
        off = sorted(s for s in self.steps if s % val_check_interval)  # max_steps among them
        if off:
            raise ConfigError(
                f"checkpoint step {off[0]} is not a validation step (trainer.val_check_interval="
                f"{val_check_interval}): make trainer.max_steps and the checkpoints steps multiples of it"
            )
        self.folder, self.max_steps, self.val_check_interval = folder, max_steps, val_check_interval
        self.weights_only = scheduled == "weights"

    def path(self, step: int) -> Path:
        """The scheduled checkpoint of `step`."""
        return self.folder / f"step-{step:07d}.ckpt"

    def validates_after(self, step: int) -> bool:
        """Whether optimizer step `step` (1-based: trainer.global_step once it is done) is followed by a validation."""
        return step % self.val_check_interval == 0 or step == self.max_steps


def read_checkpoint(path: Path) -> dict:
    """A normlab checkpoint, memory-mapped: its tensors are read from the file when used (the commands that read
    one take it through training.loader, which verifies it first)."""
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


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
    """torch.save `checkpoint` to `path` atomically (common/atomic.py), then its digest file beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = None
    try:
        with replacing(path) as f:
            writer = HashingWriter(f)
            torch.save(checkpoint, writer)
    except (OSError, RuntimeError) as e:
        error = writer.error if writer and writer.error else e
        if not isinstance(error, OSError):
            raise
        raise write_error(path, error) from None
    record = Record(writer.sha256.hexdigest(), path.stat().st_size, checkpoint["global_step"],
                    "full" if "optimizer_states" in checkpoint else "weights")
    write_atomically(digest_path(path), (json.dumps(record.__dict__) + "\n").encode())
    return record


def read_record(path: Path) -> Record:
    """What the digest file of the checkpoint `path` says of it; RunDirError where it cannot be read."""
    try:
        return Record(**json.loads(digest_path(path).read_text()))
    except FileNotFoundError:
        raise RunDirError(f"{path} has no digest file {digest_path(path).name} (a save cut short, or a checkpoint "
                          "not written by normlab)") from None
    except (ValueError, TypeError):
        raise RunDirError(f"{path}: its digest file {digest_path(path).name} is damaged") from None


def read_verified(path: Path) -> tuple[Record, dict]:
    """A checkpoint read once, into memory, verified on the bytes read and loaded from them: a file replaced while
    it is read (a run still training replaces its last.ckpt) is never taken for the one its digest file describes.
    RunDirError says what is wrong."""
    record = read_record(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RunDirError(f"cannot read {path} ({e.strerror})") from None
    if len(data) != record.bytes:
        raise RunDirError(f"{path} holds {len(data):,} bytes, its digest file says {record.bytes:,} (truncated, or "
                          "replaced while it was read)")
    if hashlib.sha256(data).hexdigest() != record.sha256:
        raise RunDirError(f"{path} does not match the sha256 in its digest file (its bytes were corrupted, or it was "
                          "replaced while it was read)")
    return record, torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def verify(path: Path) -> Record:
    """The record of an intact checkpoint; raises RunDirError saying what is wrong with a damaged one."""
    record = read_record(path)
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


def intact_checkpoint_of(run: Path, step: int) -> Path | None:
    """An intact checkpoint of the run directory `run` that holds the weights of `step` (by the step its digest file
    records), a scheduled one before last.ckpt and previous.ckpt (fewer bytes to hash); None where there is none."""
    folder = run / "checkpoints"
    candidates = [p for p in [*sorted(folder.glob("step-*.ckpt")), folder / LAST, folder / PREVIOUS]
                  if p.is_file() and recorded_step(p) == step]
    return newest_intact(candidates)[0]


def resume_choice(run: Path) -> tuple[Path | None, int, set[str]]:
    """What the run in the run directory `run` resumes from: the intact full checkpoint of the highest step
    recorded in it, that step, and the names of the damaged ones passed on the way, each reported (they are
    rewritten when the run passes their step again). No full checkpoint at all: a fresh start (None, 0), unless the
    run had got further (then its progress would be lost: refused)."""
    folder, candidates = run / "checkpoints", []
    for path in folder.glob("*.ckpt"):
        try:
            full = json.loads(digest_path(path).read_text())["contents"] == "full"
        except (OSError, ValueError, KeyError, TypeError):
            full = path.name in (LAST, PREVIOUS)  # checked (and reported) by newest_intact
        if full and not path.name.startswith("nonfinite"):
            candidates.append(path)
    candidates.sort(key=lambda p: p.name != LAST)  # at equal steps: last.ckpt first
    path, record, passed = newest_intact(candidates)
    damaged = [reason for _, reason in passed]
    if path is not None:
        for reason in damaged:
            warn(f"{reason}: not resumed from; it is rewritten when the run passes its step again")
        return path, record.step, {p.name for p, _ in passed}
    progressed = sorted(p.name for p in folder.glob("step-*.ckpt") if p.name != "step-0000000.ckpt")
    if damaged or progressed:
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        why = f"{damaged[0]}{more}" if damaged else f"it has {progressed[-1]} but no last.ckpt"
        raise RunDirError(
            f"{run} has no intact full checkpoint to resume from: {why}; restart=true moves "
            "this run aside and starts over"
        )
    return None, 0, set()
