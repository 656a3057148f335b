"""Where the project keeps its data, configs and run outputs (all relative to the checkout)."""

import hashlib
from pathlib import Path

from omegaconf import OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = PROJECT_ROOT / "conf"
DATA_DIR = PROJECT_ROOT / "data"
DOWNLOADS_DIR = DATA_DIR / "downloads"  # source archives fetched from the package registry

# Lets the configs say ${project_root:} so paths do not depend on the directory a job starts in.
OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT), replace=True)


def run_id(run_dir: str) -> str:
    """The id of the run in `run_dir` (the wandb run id): the same across resumes and requeues, a new one once
    restart=true has moved the earlier run aside to <run_dir>.replaced-<time>."""
    path = Path(run_dir)
    generation = len(list(path.parent.glob(f"{path.name}.replaced-*"))) if path.parent.is_dir() else 0
    return hashlib.sha1(f"{run_dir}#{generation}".encode()).hexdigest()[:16]


OmegaConf.register_new_resolver("run_id", run_id, replace=True)
