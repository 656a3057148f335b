"""What identifies a run: the settings that shape what it computes or records (identifies_the_run; its directory's
name, the check that a resumed run is the same run and the report's groups all go by them), and its wandb id
(run_id), kept in its directory."""

from pathlib import Path

RUN_ID_FILE = "run_id"  # in a run directory: its wandb run id (train/normlab/training/rundir/directory.py writes it)
# What a run writes into its directory: a folder that holds any of them holds a run (run_files)
RUN_FILES = (RUN_ID_FILE, "config.yaml", "metrics.csv", "angles.csv", "checkpoints")


def run_files(folder: Path) -> list[str]:
    """The files of a run that `folder` holds (RUN_FILES; checkpoints/ when it holds a checkpoint or its digest):
    the one rule by which a folder is known to hold a run, for normlab-train (which resumes, branches into or
    refuses such a folder, never starts over in it) and for every command's out= (common/outputs.py)."""
    found = [name for name in RUN_FILES[:-1] if (folder / name).is_file()]
    if (folder / "checkpoints").is_dir() and any((folder / "checkpoints").glob("*.ckpt*")):
        found.append("checkpoints")
    return found

# Settings (and everything below them) that only name, place, log or speed up a run, or say where it runs: they
# change neither what it computes (beyond float rounding) nor what it records, so they stay out of its name and may
# change when it resumes. (The devices may change because the global batch is checked itself: config.py.) The
# analysis the report makes of a run is declared with it, but is not the run.
NOT_IDENTITY = ("experiment", "experiment_name", "run_name", "run_dir", "restart", "analysis", "paths", "logger",
                "runtime",
                "hydra", "activation_checkpointing", "strategy", "trainer.devices", "trainer.num_nodes",
                "trainer.accelerator", "trainer.strategy", "trainer.deterministic", "data.dir", "data.num_workers",
                "data.verify_checksums",
                "probe.dir", "callbacks.angles.probe_dir", "callbacks.throughput",
                "checkpoints.scheduled",  # what the scheduled checkpoints hold (weights, or the optimizer's state too)
                "norm.style")  # the colour and marker of the norm's figures


def identifies_the_run(key: str) -> bool:
    """Whether the config key (dotted, or a config group such as hydra/launcher) shapes what the run computes or
    records: not one of NOT_IDENTITY, nor below one of them."""
    return not any(key == k or key.startswith((f"{k}.", f"{k}/")) for k in NOT_IDENTITY)


def run_id(run_dir: str) -> str | None:
    """The wandb run id of the run in `run_dir`: drawn at random when the run starts fresh, kept in the run
    directory, the same whenever it resumes (None before the run has started)."""
    path = Path(run_dir) / RUN_ID_FILE
    return path.read_text().strip() if path.is_file() else None
