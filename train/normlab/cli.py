"""Entry points: normlab-train, normlab-prepare, normlab-describe: thin Hydra mains over conf/ (the work is in
normlab.pipeline, normlab.prepare, normlab.plan). Nothing heavy is imported before Hydra has parsed the command line,
so that a bad command line, --help and shell completion are answered at once."""

import errno
import itertools
import sys
import tempfile
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from normlab.errors import Interrupted, NormlabError, install_signal_handlers, process_rank
from normlab.paths import CONF_DIR


def fail(message: str, code: int = 2):
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    sys.exit(code)


def check_group_choices(args: list[str]) -> None:
    """Reject an unknown option of a config group (model=7m, norm=batchnorm) in one line that lists
    the valid ones, before Hydra composes anything."""
    parser = OverridesParser.create()
    for arg in args:
        try:
            (override,) = parser.parse_overrides([arg])
        except Exception:  # flags such as -m or --cfg, and their values: Hydra reports real errors itself
            continue
        group = CONF_DIR / override.key_or_group
        if override.is_delete() or not group.is_dir() or override.key_or_group.startswith("hydra/"):  # Hydra's own
            continue
        choices = (
            override.sweep_string_iterator() if override.is_sweep_override() else [override.get_value_element_as_str()]
        )
        valid = sorted(p.stem for p in group.glob("*.yaml") if not p.stem.startswith("_"))  # _x: shared parts
        for choice in choices:
            if choice not in valid and choice != "null":
                fail(
                    f"unknown {override.key_or_group} '{choice}': choose one of {', '.join(valid)} "
                    f"(conf/{override.key_or_group}/)"
                )


class WritableOutputDir(Callback):
    """A Hydra callback: check that the run's (or the sweep's) output directory can be written before Hydra
    creates it, so that an unwritable one is a one-line error rather than a traceback."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self.check(Path(config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.check(Path(config.hydra.sweep.dir))

    @staticmethod
    def check(directory: Path) -> None:
        if not str(directory).strip():
            fail("run_dir is empty: give the run's directory, e.g. run_dir=checkpoints/myrun")
        existing = next(p for p in [directory, *directory.parents] if p.exists())
        try:
            if not existing.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(existing))
            tempfile.TemporaryFile(dir=existing).close()
        except OSError as e:
            fail(
                f"cannot write the output directory {directory} ({existing}: {e.strerror}): "
                "give a writable run_dir= (or paths.output_dir=)"
            )


def jobs_not_run() -> str:
    """'; jobs not run: ...' for a -m sweep stopped in its current job: the jobs after it, in the order Hydra's basic
    sweeper runs them (the product of the swept values, sweeper params first), each by its swept values."""
    config = HydraConfig.get()
    if config.mode != RunMode.MULTIRUN:
        return ""
    params = [f"{k}={v}" for k, v in (config.sweeper.get("params") or {}).items()]
    values: dict[str, list[str]] = {}
    for arg in params + [a for a in sys.argv[1:] if not a.startswith("-")]:
        try:
            (override,) = OverridesParser.create().parse_overrides([arg])
        except Exception:
            continue
        key = override.get_key_element()
        values[key] = list(override.sweep_string_iterator()) if override.is_sweep_override() else [None]
    swept = {k: v for k, v in values.items() if len(v) > 1}
    jobs = [" ".join(f"{k}={v}" for k, v in zip(swept, job)) for job in itertools.product(*swept.values())]
    later = jobs[config.job.num + 1 :]
    return (
        f"; jobs not run: {', '.join(later)} (run the same command again: finished runs are skipped)" if later else ""
    )


def hydra_app(config_name: str):
    """Turn `task(cfg)` into a console-script entry point over conf/<config_name>.yaml."""

    def decorate(task):
        @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)
        def run(cfg: DictConfig):
            try:
                return task(cfg)
            except NormlabError as e:
                if isinstance(e, Interrupted) and process_rank():
                    sys.exit(e.exit_code)  # rank 0 says it
                fail(f"{e}{jobs_not_run()}", e.exit_code)

        def main():
            check_group_choices(sys.argv[1:])
            run()

        main.__doc__ = task.__doc__
        return main

    return decorate


@hydra_app("train")
def train(cfg: DictConfig) -> None:
    """Train one model; resumes from the newest intact checkpoint of its run directory when there is one."""
    from normlab import pipeline

    install_signal_handlers()  # from here on, SIGTERM and SIGUSR1 stop the run (or the sweep) with its progress saved
    pipeline.train(cfg)


@hydra_app("prepare")
def prepare(cfg: DictConfig) -> None:
    """Tokenize the corpus of `data=` into data/<name>/."""
    from normlab.prepare import prepare as prepare_data

    prepare_data(cfg.data, num_proc=cfg.num_proc, ranks_file=cfg.tokenizer_ranks_file)


@hydra_app("describe")
def describe(cfg: DictConfig) -> None:
    """Parameter counts and training FLOPs per token of `model=` with `norm=`, on the meta device."""
    import torch

    from normlab.pipeline import build_model

    with torch.device("meta"):
        model = build_model(cfg)
    c = model.config
    rows = [
        ("model", f"{cfg.model.name} ({c.n_layer} layers, d={c.n_embd}, {c.n_head} heads, context {c.block_size})"),
        ("norm", cfg.norm.name),
        ("embeddings", "tied" if c.tie_embeddings else "untied"),
        ("parameters", f"{model.num_params():,}"),
        ("non-embedding parameters", f"{model.num_params(non_embedding=True):,}"),
        ("training FLOPs per token", f"{model.flops_per_token():,}  (6 N_matmul + 12 L T d)"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
