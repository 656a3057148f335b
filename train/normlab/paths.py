"""Where the project keeps its data, configs and run outputs (project_root), and how a run's
directory is named: ${model}-${norm}-seed${seed}, plus a tag of every other command-line setting that shapes
the run, so that the jobs of any `-m` sweep get directories (and wandb runs) of their own."""

import hashlib
import os
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

PACKAGE_DIR = Path(__file__).resolve().parent
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
RUN_ID_FILE = "run_id"  # in a run directory: its wandb run id (train/normlab/run_dir.py writes it)

# Settings (and everything below them) that only name, place, log or speed up a run, or say where it runs: they
# change neither what it computes (beyond float rounding) nor what it records, so they stay out of its name and may
# change when it resumes. (The devices may change because the global batch is checked itself: run_dir.py.)
NOT_IDENTITY = ("experiment", "experiment_name", "run_name", "run_dir", "restart", "paths", "logger", "runtime",
                "hydra", "activation_checkpointing", "strategy", "trainer.devices", "trainer.num_nodes",
                "trainer.accelerator", "trainer.strategy", "data.dir", "data.num_workers", "data.verify_checksums",
                "probe.dir", "callbacks.angles.probe_dir", "callbacks.throughput")
IN_THE_NAME = ("model", "norm", "seed")  # the group choices and the seed (model.lr, say, goes into the tag)
TAG_LENGTH = 60  # longer tags keep their first characters and a hash of the whole

OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT), replace=True)


def identifies_the_run(key: str) -> bool:
    """Whether the config key (dotted, or a config group such as hydra/launcher) shapes what the run computes or
    records: not one of NOT_IDENTITY, nor below one of them."""
    return not any(key == k or key.startswith((f"{k}.", f"{k}/")) for k in NOT_IDENTITY)


def run_tag(*, _root_: DictConfig) -> str:
    """`-key=value,...` of the command-line overrides that shape the run (sorted; numbers written canonically,
    1e-3 and 0.001 alike), or '' when there are none. A tag longer than TAG_LENGTH, or with characters unsafe in a
    file name, is shortened: keys to their last part (callbacks.scheduled_checkpoints.every -> every), unsafe
    characters to '_', cut to length, and an 8-character hash of the whole tag appended."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if "hydra" in _root_:  # composed with the Hydra config (tests)
        overrides = list(_root_.hydra.overrides.task)
    elif HydraConfig.initialized():  # inside a Hydra app
        overrides = list(HydraConfig.get().overrides.task)
    else:
        return ""
    items = {}  # key -> (prefix, value)
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if key in IN_THE_NAME or not identifies_the_run(key):
            continue
        if override.is_delete():
            items[key] = ("~", None)
        else:
            items[key] = ("+" if override.is_add() else "", canonical(override.value()))
    if not items:
        return ""
    keys = sorted(items)
    tag = ",".join(f"{items[k][0]}{k}" + ("" if items[k][1] is None else f"={items[k][1]}") for k in keys)
    if len(tag) <= TAG_LENGTH and re.fullmatch(r"[A-Za-z0-9._=,+~-]*", tag):
        return f"-{tag}"
    short = ",".join(f"{items[k][0]}{re.split('[./]', k)[-1]}" + ("" if items[k][1] is None else f"={items[k][1]}")
                     for k in keys)
    short = re.sub(r"[^A-Za-z0-9._=,+~-]", "_", short)[: TAG_LENGTH - 9]
    return f"-{short}-{hashlib.sha1(tag.encode()).hexdigest()[:8]}"


def canonical(value) -> str:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(canonical(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{canonical(v)}" for k, v in value.items()) + "}"
    return str(value)


def run_id(run_dir: str) -> str | None:
    """The wandb run id of the run in `run_dir`: drawn at random when the run starts fresh, kept in the run
    directory, the same whenever it resumes (None before the run has started)."""
    path = Path(run_dir) / RUN_ID_FILE
    return path.read_text().strip() if path.is_file() else None


OmegaConf.register_new_resolver("run_tag", run_tag, replace=True)
OmegaConf.register_new_resolver("run_id", run_id, replace=True)
