"""Composing normlab's configs (conf/): the OmegaConf resolvers they use, which whatever composes a config registers
first (the command-line apps, hydra_app in cli.py; compose below for the preflight and the tests), and compose, which
composes one in-process as the command line would (its moved keys read as they are now: common/moved.py)."""

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from normlab.common.moved import current_overrides
from normlab.common.paths import CONF_DIR, PROJECT_ROOT
from normlab.common.run_identity import run_id
from normlab.common.run_names import run_tag


def register_resolvers() -> None:
    """${project_root:}, ${run_tag:} (the run directory's name) and ${run_id:<run_dir>} (its wandb id)."""
    OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT), replace=True)
    OmegaConf.register_new_resolver("run_tag", run_tag, replace=True)
    OmegaConf.register_new_resolver("run_id", run_id, replace=True)


def compose(config_name: str, overrides: list[str] = (), with_hydra: bool = False) -> DictConfig:
    """conf/<config_name>.yaml with the command-line `overrides` (with_hydra: and Hydra's own config, which names the
    overrides for the run's name)."""
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name, overrides=current_overrides(list(overrides)),
                             return_hydra_config=with_hydra)
