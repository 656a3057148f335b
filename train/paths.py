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
# ${stable_id:${run_dir}}: the same id for the same run directory, e.g. the wandb run id across requeues.
OmegaConf.register_new_resolver("stable_id", lambda text: hashlib.sha1(str(text).encode()).hexdigest()[:16], replace=True)
