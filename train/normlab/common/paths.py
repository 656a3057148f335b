"""Where the project keeps its data, configs and run outputs: project_root, and the folders under it."""

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # normlab/common/paths.py -> normlab/
CHECKOUT = PACKAGE_DIR.parents[1]  # train/normlab/ -> the checkout, when the package runs from one


def project_root() -> Path:
    """Where data/ and checkpoints/ live: $NORMLAB_ROOT if set, else the checkout the package runs from (an editable
    install), else the working directory (a wheel install)."""
    if os.environ.get("NORMLAB_ROOT"):
        return Path(os.environ["NORMLAB_ROOT"]).resolve()
    if (CHECKOUT / "pyproject.toml").is_file() and (CHECKOUT / "conf").is_dir():
        return CHECKOUT
    return Path.cwd()


PROJECT_ROOT = project_root()
# The configs shipped in the package (a wheel install), or the checkout's conf/ (an editable install maps them)
CONF_DIR = PACKAGE_DIR / "conf" if (PACKAGE_DIR / "conf").is_dir() else CHECKOUT / "conf"
DATA_DIR = PROJECT_ROOT / "data"
DOWNLOADS_DIR = DATA_DIR / "downloads"  # source archives fetched from the package registry
