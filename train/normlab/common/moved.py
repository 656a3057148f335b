"""What moved since a run directory, a checkpoint or a command line was written, and where it is now: the classes a
saved config names (`_target_`), keys, and keys added since. The peak learning rate, once `model.lr` (interpolated
into optimizer.lr), is `optimizer.lr`; the run directory's checkpoint schedule, once the removable callback
`callbacks.scheduled_checkpoints`, is `checkpoints`; what a norm is, once the keys `norm.centred`, `norm.normalizes`
and `norm.bias`, its class states (model.norms.traits); `branch.moments`, added since, was `fresh` before it. Every
reader of a saved config takes it through current_config, and every command line is read through current_overrides,
so that old runs load, resume and report with new ones and old commands keep working (tests/test_run_dir.py,
tests/test_config.py)."""

import itertools
import re

# Where the classes a saved config names (`_target_`) lived before normlab had subpackages: a run directory or a
# checkpoint written then names them so (tests/test_layout.py).
MOVED_TARGETS = {
    "normlab.norms.": "normlab.model.norms.",
    "normlab.data.TokenDataModule": "normlab.data.datamodule.TokenDataModule",
    "normlab.run_dir.": "normlab.training.rundir.directory.",
    "normlab.callbacks.": "normlab.training.callbacks.",
    "normlab.loggers.": "normlab.training.loggers.",
    "normlab.strategies.": "normlab.training.strategies.",
}
MOVED_KEYS = {"model.lr": "optimizer.lr", "callbacks.scheduled_checkpoints": "checkpoints"}
# What the callback's config held besides the schedule: its class and copies of run_dir and trainer settings
NOT_THE_SCHEDULE = ("_target_", "path", "max_steps", "val_check_interval")
NORM_TRAITS = ("centred", "normalizes", "bias")  # keys of `norm` once: its class states them (model.norms.traits)
# Keys added since, each with the value every run written before it had: a branch restarted its optimizer afresh
ADDED_KEYS = {("branch", "moments"): "fresh"}


def current_config(config: dict) -> dict:
    """A saved config (nested dicts and lists) as it is written now: moved classes named by their place now; without
    model.lr, which only ever reached training as optimizer.lr (saved resolved beside it); the checkpoint schedule
    under `checkpoints`; without the norm's NORM_TRAITS keys, which reached nothing but the report; the ADDED_KEYS it
    lacks at the value it had."""
    config = current_targets(config)
    model, callbacks, norm = config.get("model"), config.get("callbacks"), config.get("norm")
    if isinstance(norm, dict):
        config["norm"] = {k: v for k, v in norm.items() if k not in NORM_TRAITS}
    if isinstance(model, dict) and "lr" in model:
        config["model"] = {k: v for k, v in model.items() if k != "lr"}
    if isinstance(callbacks, dict) and isinstance(callbacks.get("scheduled_checkpoints"), dict):
        schedule = callbacks["scheduled_checkpoints"]
        config["callbacks"] = {k: v for k, v in callbacks.items() if k != "scheduled_checkpoints"}
        config["checkpoints"] = {k: v for k, v in schedule.items() if k not in NOT_THE_SCHEDULE}
    for (section, key), value in ADDED_KEYS.items():
        if isinstance(config.get(section, {}), dict) and key not in config.get(section, {}):
            config[section] = {**config.get(section, {}), key: value}
    return config


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


def current_overrides(args: list[str]) -> list[str]:
    """Command-line arguments with each override of a moved key (a sweep, an addition, a deletion) by its key now:
    model.lr=1e-3,3e-3 -> optimizer.lr=1e-3,3e-3; callbacks.scheduled_checkpoints.every=50 -> checkpoints.every=50."""
    current = []
    for arg in args:
        for old, new in MOVED_KEYS.items():
            if match := re.fullmatch(rf"(~|\+\+?)?{re.escape(old)}([.=].*)?", arg, re.DOTALL):
                arg = f"{match[1] or ''}{new}{match[2] or ''}"
        current.append(arg)
    return current


def spellings(keys: list[str]) -> list[dict[str, str]]:
    """Each way the (dotted) keys may have been typed, moved keys by their place now or before: key -> spelling."""
    options = [[key, *(old + key.removeprefix(new) for old, new in MOVED_KEYS.items()
                       if key == new or key.startswith(f"{new}."))] for key in keys]
    return [dict(zip(keys, chosen)) for chosen in itertools.product(*options)]
