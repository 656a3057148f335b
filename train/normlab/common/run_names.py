"""How a run's directory is named: ${model}-${norm}-seed${seed}, plus a tag of every other command-line setting that
shapes the run (run_tag), so that the jobs of any `-m` sweep get directories (and wandb runs) of their own; a run
directory named by the earlier scheme (`-key=value,...`) keeps its name."""

import hashlib
import math
import re
from pathlib import Path

from omegaconf import DictConfig

from normlab.common.moved import spellings
from normlab.common.run_identity import identifies_the_run

IN_THE_NAME = ("model", "norm", "seed")  # the group choices and the seed (optimizer.lr, say, goes into the tag)
TAG_LENGTH = 60  # longer tags keep their first characters and a hash of the whole


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
    (`-model.lr=0.001`, a moved key by its place now or before) that exists, where the new name's does not, keeps
    its name: it resumes."""
    items = tag_items(_root_)
    if not items:
        return ""
    names = short_names(list(items))
    parts = [readable(names[k], *items[k]) for k in sorted(items, key=lambda k: names[k])]
    tag = "-".join(parts)
    if len(tag) > TAG_LENGTH:  # whole items while they fit, then a hash of them all
        kept = [part for i, part in enumerate(parts) if len("-".join(parts[: i + 1])) <= TAG_LENGTH - 10]
        tag = "-".join([*kept, f"h{hashlib.sha1(tag.encode()).hexdigest()[:8]}"])
    if not run_exists(_root_, f"-{tag}"):
        for spelled in spellings(list(items)):
            earlier = legacy_tag({spelled[k]: item for k, item in items.items()})
            if run_exists(_root_, earlier):
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
