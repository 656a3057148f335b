"""Where the project keeps its data, configs and run outputs (project_root), and how a run's
directory is named: ${model}-${norm}-seed${seed}, plus a tag of every other command-line setting that shapes
the run, so that the jobs of any `-m` sweep get directories (and wandb runs) of their own."""

import hashlib
import math
import os
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

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
RUN_ID_FILE = "run_id"  # in a run directory: its wandb run id (train/normlab/training/run_dir.py writes it)

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


def tag_items(_root_: DictConfig) -> dict[str, tuple[str, object]] | None:
    """key -> (prefix, value) of the command-line overrides that shape the run; None outside Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if "hydra" in _root_:  # composed with the Hydra config (tests)
        overrides = list(_root_.hydra.overrides.task)
    elif HydraConfig.initialized():  # inside a Hydra app
        overrides = list(HydraConfig.get().overrides.task)
    else:
        return None
    items = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if key in IN_THE_NAME or not identifies_the_run(key):
            continue
        items[key] = ("~", None) if override.is_delete() else ("+" if override.is_add() else "", override.value())
    return items


def run_tag(*, _root_: DictConfig) -> str:
    """`-name value-...` of the command-line overrides that shape the run, or '' when there are none: each key by
    its last part (the shortest dotted ending that tells it from the others), then its value, numbers written one
    way (1e-3 and 0.001 alike: `lr1e-3`), other values after '_' (`data_hub`); sorted. Only letters, digits and
    `._-`, so that a user can type the name back unquoted (model_path=.../tiny-rmsnorm-seed0-lr1e-3). A tag longer
    than TAG_LENGTH is cut and ends in an 8-character hash of the whole. A run directory of the earlier name
    (`-model.lr=0.001`) that exists, where the new name's does not, keeps its name: it resumes."""
    items = tag_items(_root_)
    if not items:
        return ""
    names = short_names(list(items))
    parts = [readable(names[k], *items[k]) for k in sorted(items, key=lambda k: names[k])]
    tag = "-".join(parts)
    if len(tag) > TAG_LENGTH:  # whole items while they fit, then a hash of them all
        kept = [part for i, part in enumerate(parts) if len("-".join(parts[: i + 1])) <= TAG_LENGTH - 10]
        tag = "-".join([*kept, f"h{hashlib.sha1(tag.encode()).hexdigest()[:8]}"])
    earlier = legacy_tag(items)
    if earlier != f"-{tag}" and run_exists(_root_, earlier) and not run_exists(_root_, f"-{tag}"):
        return earlier
    return f"-{tag}"


def short_names(keys: list[str]) -> dict[str, str]:
    """Each dotted key (or group/option path) by its shortest ending that no other key of `keys` shares."""
    parts = {k: re.split("[./]", k) for k in keys}
    names = {}
    for key, split in parts.items():
        for n in range(1, len(split) + 1):
            ending = split[-n:]
            if not any(other != key and theirs[-n:] == ending for other, theirs in parts.items()):
                break
        names[key] = "_".join(ending)
    return names


def readable(name: str, prefix: str, value) -> str:
    if prefix == "~":
        return f"no_{name}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        text = f"{name}{compact(value)}"
    elif isinstance(value, (list, tuple)):
        text = f"{name}_" + "_".join(compact(v) if isinstance(v, (int, float)) else str(v) for v in value)
    else:
        text = f"{name}_{value}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


def compact(number) -> str:
    """The shorter of 0.003 and 3e-3 (the same for every spelling of the number)."""
    if isinstance(number, bool) or not isinstance(number, float) or not math.isfinite(number):
        return str(number)  # inf and nan too: checks.py refuses them, in a line that names the run
    plain = f"{number:g}"
    mantissa, _, exponent = f"{number:e}".partition("e")
    scientific = f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return scientific if len(scientific) < len(plain) else plain


def legacy_tag(items: dict[str, tuple[str, object]]) -> str:
    """The tag of the earlier naming (`-key=value,...`; long ones shortened and hashed), for run directories made
    before the names became readable."""
    values = {k: (prefix, None if value is None else canonical(value)) for k, (prefix, value) in items.items()}
    keys = sorted(values)
    tag = ",".join(f"{values[k][0]}{k}" + ("" if values[k][1] is None else f"={values[k][1]}") for k in keys)
    if len(tag) <= TAG_LENGTH and re.fullmatch(r"[A-Za-z0-9._=,+~-]*", tag):
        return f"-{tag}"
    short = ",".join(f"{values[k][0]}{re.split('[./]', k)[-1]}" + ("" if values[k][1] is None else f"={values[k][1]}")
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


def run_exists(_root_: DictConfig, tag: str) -> bool:
    """Whether the run directory the config names with `tag` exists (its default place, under paths.output_dir)."""
    try:
        folder = Path(str(_root_.paths.output_dir)) / str(_root_.experiment_name)
        name = f"{_root_.model.name}-{_root_.norm.name}-seed{_root_.seed}{tag}"
    except Exception:  # a config without these keys: no earlier run to keep
        return False
    return (folder / name).is_dir()


def run_id(run_dir: str) -> str | None:
    """The wandb run id of the run in `run_dir`: drawn at random when the run starts fresh, kept in the run
    directory, the same whenever it resumes (None before the run has started)."""
    path = Path(run_dir) / RUN_ID_FILE
    return path.read_text().strip() if path.is_file() else None


OmegaConf.register_new_resolver("run_tag", run_tag, replace=True)
OmegaConf.register_new_resolver("run_id", run_id, replace=True)


# Where the classes a saved config names (`_target_`) lived before normlab had subpackages: a run directory or a
# checkpoint written then names them so, and every reader of a saved config maps them here (tests/test_layout.py).
MOVED_TARGETS = {
    "normlab.norms.": "normlab.model.norms.",
    "normlab.data.TokenDataModule": "normlab.data.datamodule.TokenDataModule",
    "normlab.run_dir.": "normlab.training.run_dir.",
    "normlab.callbacks.": "normlab.training.callbacks.",
    "normlab.loggers.": "normlab.training.loggers.",
    "normlab.strategies.": "normlab.training.strategies.",
}


def current_targets(config):
    """A saved config (nested dicts and lists) with each `_target_` of a moved class named by its place now."""
    if isinstance(config, dict):
        return {k: current_target(v) if k == "_target_" else current_targets(v) for k, v in config.items()}
    if isinstance(config, list):
        return [current_targets(v) for v in config]
    return config


def current_target(target):
    for old, new in MOVED_TARGETS.items():
        if isinstance(target, str) and target.startswith(old):
            return new + target.removeprefix(old)
    return target
