"""The run directory's owner while a run trains, in the spirit of torchtitan's CheckpointManager: `RunDirectory`, which
train() builds from run_dir and the `checkpoints` settings (pipeline.build_run_directory) and hands to the Trainer as
a callback (the other callbacks find it with RunDirectory.of(trainer)) and as its checkpoint IO plugin

- claims the directory for one process before anything is written (claim.py), and releases it at the end;
- checks that the directory holds a run of the same config (config.py), or moves that run aside with
  restart=true, and keeps the run's wandb id (`run_id`: new for a fresh run, the same whenever it resumes);
- resumes from the intact full checkpoint of the highest step recorded in it (checkpoints.py), and makes
  metrics.csv and angles.csv consistent with that checkpoint (tables.py), finding the checkpoints that hold the
  weights of validations metrics.csv lost (train() validates them again: revalidate.py);
- saves `last.ckpt` (full training state) after every validation, the previous one kept as `previous.ckpt`, and the
  scheduled `step-NNNNNNN.ckpt` (model weights and config; full state with scheduled=full): each atomically with
  its digest file, once the rows logged so far are on disk, so that a checkpoint never runs ahead of its rows;
- saves and restores every rank's random generators (dropout) in the full checkpoints.

The modules it delegates to import no Lightning: the commands that only read a run directory import them alone.
"""

import os
import random
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Checkpoint
from omegaconf import DictConfig, OmegaConf

from normlab.common.atomic import link_over
from normlab.common.errors import ConfigError, process_rank
from normlab.common.run_identity import RUN_ID_FILE
from normlab.training.rundir.checkpoints import (
    LAST,
    PREVIOUS,
    CheckpointSchedule,
    digest_path,
    intact_checkpoint_of,
    resume_choice,
    write_checkpoint,
)
from normlab.training.rundir.claim import CLAIM_FILE, Claim, this_process
from normlab.training.rundir.config import CONFIG_FILE, check_no_run_lost, check_saved_config
from normlab.training.rundir.files import RunDirError, remove_partial_writes, warn, write_atomically
from normlab.training.rundir.tables import RunTables


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


def every_ranks_rng_states() -> list[dict]:
    """The random generators of every rank, by rank (every rank calls this)."""
    states = rng_states()
    if dist.is_available() and dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, states)
        return gathered
    return [states]


def restore_rng_states(trainer: L.Trainer, states: list[dict]) -> None:
    """This rank's generators as a checkpoint's `states` hold them; a warning where it holds another number of ranks
    (dropout masks then differ from the original run's)."""
    if len(states) == trainer.world_size:
        set_rng_states(states[trainer.global_rank])
    elif states and trainer.is_global_zero:
        warn(
            f"the checkpoint holds random states of {len(states)} processes, this run has "
            f"{trainer.world_size}: dropout masks will differ from the original run"
        )


class RunDirectory(Checkpoint):
    """The owner of a run directory (see the module's docstring). train() opens it before the Trainer exists and
    closes it at the end; the other callbacks find it with RunDirectory.of(trainer). `schedule`: the settings of
    `checkpoints` in the config (CheckpointSchedule's every, dense_until, sparse_every, scheduled, extra_steps);
    `first_step`: the step the run starts at (a branch's branch.step, else 0)."""

    def __init__(self, path: str, max_steps: int, val_check_interval: int, first_step: int = 0, **schedule):
        if not str(path).strip():
            raise ConfigError("run_dir is empty: give the run's directory, e.g. run_dir=checkpoints/myrun")
        self.path = Path(path)
        self.dir = self.path / "checkpoints"
        self.schedule = CheckpointSchedule(self.dir, max_steps, val_check_interval, **schedule)
        self.claim, self.tables, self.io = Claim(self.path / CLAIM_FILE), RunTables(self.path), VerifiedCheckpointIO()
        self.resume_path: Path | None = None
        self.resume_step, self.first_step = 0, first_step
        self.damaged: set[str] = set()  # names of checkpoints found damaged: never promoted to previous.ckpt
        self.last_good: Path | None = None  # the newest checkpoint this process verified or wrote
        self.last_saved, self.last_saved_step = None, None  # the last full checkpoint this process wrote, its step
        self.lost_validations: dict[int, Path] = {}  # (rank 0) validations metrics.csv lost -> a checkpoint of them

    def holds_checkpoints(self) -> bool:
        """Whether the directory holds a checkpoint, which a start (restart=false) resumes from."""
        return any(self.dir.glob("*.ckpt"))

    @staticmethod
    def of(trainer: L.Trainer) -> "RunDirectory | None":
        return next((c for c in trainer.callbacks if isinstance(c, RunDirectory)), None)

    # -- start and end

    @contextmanager
    def opened(self, cfg: DictConfig, overrides: list[str], start: dict | None = None):
        """Claim the directory and prepare it for the run (rank 0), or wait for rank 0 to have done so (other
        ranks); set resume_path and resume_step. `start`: the first checkpoint of a run that starts at a step of
        another (a branch: training/branch.py), written where the directory holds none. Release the claim at the
        end; a directory that got nothing but the claim is removed."""
        existed = self.path.is_dir() and any(self.path.iterdir())
        try:
            if process_rank() == 0:
                self.path.mkdir(parents=True, exist_ok=True)
                self.claim.acquire()
                self.prepare(cfg, overrides, start)
            else:
                chosen = self.claim.join()["resume"]
                self.resume_path = self.path / chosen["path"] if chosen["path"] else None
                self.resume_step = chosen["step"]
            yield self
        finally:
            devices = cfg.trainer.devices if isinstance(cfg.trainer.devices, int) else 2  # "auto": maybe several
            several_ranks = devices * cfg.trainer.num_nodes > 1
            self.claim.release(for_other_ranks=several_ranks and self.resume_step >= self.schedule.max_steps)
            if not existed and self.path.is_dir() and not any(self.path.iterdir()):
                self.path.rmdir()

    def prepare(self, cfg: DictConfig, overrides: list[str], start: dict | None = None) -> None:
        if cfg.restart:
            self.move_aside()
        elif self.holds_checkpoints():
            check_saved_config(self.path, cfg)
        else:
            check_no_run_lost(self.path, cfg)
        remove_partial_writes(self.dir)
        remove_partial_writes(self.path)
        self.resume_path, self.resume_step, damaged = resume_choice(self.path)
        # what the run is, before any checkpoint of it: a start cut short (a full disk) is then started again
        if not (self.path / RUN_ID_FILE).is_file():
            write_atomically(self.path / RUN_ID_FILE, (os.urandom(8).hex() + "\n").encode())
        config = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
        write_atomically(self.path / CONFIG_FILE, OmegaConf.to_yaml(config, resolve=True).encode())
        write_atomically(self.path / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(overrides)).encode())
        since = self.first_step
        if self.resume_path is None and start is not None:
            checkpoint = start
            for path in (self.schedule.path(since), self.dir / LAST):
                write_checkpoint(checkpoint, path)
            print(f"branched {self.path} from {checkpoint['branched_from']['source']} at step {since}",
                  file=sys.stderr, flush=True)
            self.resume_path, self.resume_step, damaged = resume_choice(self.path)
        self.damaged.update(damaged)
        self.last_good = self.resume_path
        if self.resume_path is not None:
            print(
                f"resuming {self.path} from {self.resume_path.relative_to(self.path)} at step {self.resume_step}",
                file=sys.stderr,
                flush=True,
            )
        self.lost_validations = self.tables.keep_metrics_before(
            self.resume_step, self.schedule.validates_after, lambda step: intact_checkpoint_of(self.path, step), since
        )
        if since and self.resume_step == since and self.schedule.validates_after(since):
            self.lost_validations[since] = self.schedule.path(since)  # a branch's first row: its start validated
        self.tables.keep_angles_until(self.resume_step)
        chosen = str(self.resume_path.relative_to(self.path)) if self.resume_path else None
        self.claim.update({**this_process(), "resume": {"path": chosen, "step": self.resume_step}})

    def move_aside(self) -> None:
        """restart=true: move what the directory holds to <run_dir>.replaced-<time> (nothing is deleted); the new
        run gets a new wandb id."""
        entries = sorted(p for p in self.path.iterdir() if p.name != CLAIM_FILE)
        if entries:
            aside = self.path.with_name(f"{self.path.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
            aside.mkdir()
            checkpoints = len(list(self.dir.glob("*.ckpt")))
            moved = [f"{p.name}/ ({checkpoints} checkpoints)" if p == self.dir else p.name + "/" * p.is_dir()
                     for p in entries]
            for entry in entries:
                entry.rename(aside / entry.name)
            print(f"restart=true: moved the earlier run ({', '.join(moved)}) to {aside}", file=sys.stderr)

    # -- saving

    def save(self, trainer: L.Trainer, path: Path, weights_only: bool) -> None:
        """Save a checkpoint (every rank calls this; rank 0 writes). The rows logged so far reach the disk first. A
        failed write stops every rank with its one-line reason."""
        if trainer.is_global_zero:
            self.tables.sync()
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
            link_over(last, previous)
            if digest_path(last).is_file():
                write_atomically(digest_path(previous), digest_path(last).read_bytes())
            self.damaged.discard(PREVIOUS)
        self.save(trainer, last, weights_only=False)
        self.last_saved, self.last_saved_step = last, trainer.global_step
        return last

    def on_train_start(self, trainer, pl_module):
        if trainer.global_step == 0 and 0 in self.schedule.steps:
            self.save(trainer, self.schedule.path(0), weights_only=self.schedule.weights_only)

    def save_step(self, trainer: L.Trainer) -> Path:
        """What is saved after a validation: the scheduled checkpoint of the step (also when one exists: passing a
        step again rewrites a damaged checkpoint of it), then last.ckpt."""
        step = trainer.global_step
        if step in self.schedule.steps:
            self.save(trainer, self.schedule.path(step), weights_only=self.schedule.weights_only)
        return self.save_last(trainer)

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.save_step(trainer)

    # every rank's random generators, in the full checkpoints (Lightning keeps none)
    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["rng_states"] = every_ranks_rng_states()

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        restore_rng_states(trainer, checkpoint.get("rng_states", []))
