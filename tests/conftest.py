import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from train.paths import CONF_DIR, DATA_DIR

BIN = Path(sys.executable).parent
EMBEDDED = DATA_DIR / "embedded"

# Small enough for a few CPU seconds per run; real configs, real data, real Lightning.
FAST_TRAIN = [
    "model.n_layer=2",
    "data.batch_size=2",
    "data.val_tokens=1024",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "callbacks.scheduled_checkpoints.every=2",
    "callbacks.scheduled_checkpoints.dense_until=4",
    "callbacks.scheduled_checkpoints.sparse_every=6",
    "logger=csv",
]


def compose_config(config_name: str = "train", overrides: list[str] = (), with_hydra: bool = False):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides), return_hydra_config=with_hydra)


def run_cli(tool: str, *args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "WANDB_MODE": "offline", **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None removes a variable
    return subprocess.run([str(BIN / tool), *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=600)


@pytest.fixture(scope="session")
def prepared() -> Path:
    """The embedded corpus, prepared by the real `normlab-prepare` (once per checkout)."""
    if not (EMBEDDED / "meta.json").is_file():
        result = run_cli("normlab-prepare", "data=embedded")
        assert result.returncode == 0, result.stderr
    return EMBEDDED


@pytest.fixture
def prepared_copy(prepared, tmp_path) -> Path:
    """A private copy of the prepared corpus that a test may damage."""
    return Path(shutil.copytree(prepared, tmp_path / "embedded"))
