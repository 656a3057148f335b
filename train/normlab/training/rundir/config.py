"""Whether a run directory's saved config.yaml describes the run about to resume in it: the settings that shape what
a run computes or records must match (common.run_identity.identifies_the_run), and so must the sequences per
optimizer step; what names, places, logs or speeds up a run, and where it runs, may change. A config saved before a
class or a key moved is read as it is written now (common.moved.current_config)."""

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from normlab.common.moved import current_config
from normlab.common.run_identity import identifies_the_run, run_files
from normlab.training.rundir.files import RunDirError

CONFIG_FILE = "config.yaml"
TABLES = ("metrics.csv", "angles.csv")


def flat(config, prefix: str = "") -> dict:
    """A nested config as one dict of dotted keys."""
    items = {}
    for key, value in config.items():
        if isinstance(value, dict):
            items.update(flat(value, f"{prefix}{key}."))
        else:
            items[f"{prefix}{key}"] = value
    return items


def is_off(value) -> bool:
    """A key added to normlab since a run was written, at None or False, is what that run had (0 is a value)."""
    return value is None or value is False


def effective(settings: dict) -> dict:
    """Flat settings less a norm's site settings that equal its layer's (norm.sites.mlp.alpha_init = norm.layer's):
    a run written before norm.sites existed had them so."""
    return {k: v for k, v in settings.items()
            if not (k.startswith("norm.sites.") and settings.get(f"norm.layer.{k.rsplit('.', 1)[1]}") == v)}


def has_rows(table: Path) -> bool:
    """Whether a CSV table holds a row below its header."""
    try:
        with open(table, "rb") as f:
            return sum(1 for line in f if line.strip()) > 1
    except OSError:
        return False


def check_no_run_lost(run: Path, cfg: DictConfig) -> None:
    """The run directory `run` holds no checkpoint to resume from: a run starts in it only where nothing of an
    earlier run would be lost. Where it holds a run's files (run_identity.run_files) its config.yaml must be the
    run's (a start that never saved a checkpoint, run again), and metrics.csv and angles.csv must hold no row (a run
    whose checkpoints were deleted: its tables would be replaced)."""
    found = run_files(run)
    if CONFIG_FILE in found:
        check_saved_config(run, cfg, held="a run")
    if rows := [name for name in TABLES if has_rows(run / name)]:
        raise RunDirError(f"{run} holds a run whose checkpoints are gone ({', '.join(found)}; rows in "
                          f"{' and '.join(rows)}), which a start here would replace: give another run_dir, or "
                          "restart=true to move that run aside and start over")


def check_saved_config(run: Path, cfg: DictConfig, held: str = "checkpoints") -> None:
    """Refuse the run directory `run`, which holds checkpoints (or, `held`, another run's files), when its
    config.yaml is missing, damaged, or another config than `cfg` (what only names, places, logs or speeds up a run
    may differ: run_identity.NOT_IDENTITY)."""
    saved = run / CONFIG_FILE
    if not saved.is_file():
        raise RunDirError(
            f"{run} holds checkpoints but no config.yaml to check them against: give another "
            "run_dir, or restart=true to move that run aside and start over"
        )
    try:
        old = flat(current_config(OmegaConf.to_container(OmegaConf.load(saved), resolve=True)))
    except Exception as e:  # yaml and OmegaConf errors alike
        raise RunDirError(
            f"{saved} is damaged ({type(e).__name__}: {str(e).splitlines()[0]}): restore it, or "
            "restart=true to move that run aside and start over"
        ) from None
    new = flat(OmegaConf.to_container(cfg, resolve=True))
    for config in (old, new):  # where it runs may change, not how many sequences an optimizer step sees
        devices = [
            config.get(k) if isinstance(config.get(k), int) else 1 for k in ("trainer.devices", "trainer.num_nodes")
        ]
        per_step = config.get("data.batch_size", 0) * devices[0] * devices[1]
        config["sequences per optimizer step"] = config.get("global_batch_size") or per_step
    for config in (old, new):  # a branch's source, recorded relative by earlier versions, absolute now
        if isinstance(config.get("branch.source"), str):
            config["branch.source"] = str(Path(config["branch.source"]).resolve())
    # a run directory that was moved keeps its identity: paths inside it follow it
    old = {k: v.replace(old.get("run_dir", "\0"), new["run_dir"]) if isinstance(v, str) else v for k, v in old.items()}
    old, new = effective(old), effective(new)
    changed = [
        k
        for k in sorted(old.keys() | new.keys(), key=lambda k: (k.startswith("callbacks."), k))
        if identifies_the_run(k) and old.get(k) != new.get(k) and not (k not in old and is_off(new.get(k)))
    ]  # callbacks last: mostly copies
    if changed:
        shown = ", ".join(f"{k}: {old.get(k)} -> {new.get(k)}" for k in changed[:3]) + (
            " ..." if len(changed) > 3 else ""
        )
        raise RunDirError(
            f"{run} holds {held} of another config ({shown}): give another run_dir, "
            "or restart=true to move that run aside and start over"
        )
