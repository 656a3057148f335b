"""Entry points: normlab-train, -prepare, -describe, -angles, -ablate, -report, -export, -sample, -eval and
-convert: thin Hydra mains over conf/ (the work is in the module of the same name; normlab-train's in
training.pipeline, normlab-describe's in cluster.plan, normlab-eval's in interop.evaluate, normlab-convert's in
interop.convert; normlab-bench's is normlab.bench.main). Nothing heavy is imported before Hydra has parsed the
command line, so that a bad command line, --help and shell completion are answered at once."""

import contextlib
import errno
import importlib.util
import io
import itertools
import re
import sys
import tempfile
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from normlab.common.compose import compose, register_resolvers
from normlab.common.errors import (
    Interrupted,
    NormlabError,
    install_signal_handlers,
    process_rank,
    requeue_with_submitit,
)
from normlab.common.moved import current_overrides
from normlab.common.paths import CONF_DIR


def fail(message: str, code: int = 2, program: str | None = None):
    print(f"{program or Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    sys.exit(code)


def check_command_line(config_name: str, args: list[str]) -> None:
    """Answer in one line, before Hydra runs, what Hydra would answer with its usage block or a multi-line error: an
    unknown option of a config group (model=7m, norm=batchnorm; listing the valid ones), an unknown flag, an argument
    that is not an override (a bare path), a key that the config does not have, a sweep without -m."""
    parser = OverridesParser.create()
    folders = [CONF_DIR, *user_config_folders(args)]
    for arg in args:
        try:
            (override,) = parser.parse_overrides([arg])
        except OverrideParseException:  # flags and their values; an argument that is no override: below
            continue
        group = CONF_DIR / override.key_or_group
        if override.is_delete() or not group.is_dir() or override.key_or_group.startswith("hydra/"):  # Hydra's own
            continue
        choices = (  # a list: the checks below read it twice
            list(override.sweep_string_iterator()) if override.is_sweep_override()
            else [override.get_value_element_as_str()]
        )
        valid = sorted({p.stem for folder in folders for p in (folder / override.key_or_group).glob("*.yaml")})
        shadowed = [folder / override.key_or_group / f"{choice}.yaml" for choice in choices for folder in folders[1:]
                    if (folder / override.key_or_group / f"{choice}.yaml").is_file()
                    and (CONF_DIR / override.key_or_group / f"{choice}.yaml").is_file()]
        if shadowed:
            fail(f"your {shadowed[0]} has the name of normlab's own {override.key_or_group}={shadowed[0].stem}, "
                 "which Hydra takes in its place: rename your file (and the name in it)")
        for choice in choices:
            if choice not in valid and choice != "null":
                yours = " or your config folders'" if len(folders) > 1 else ""
                own = "; a norm of your own: docs/norms.md" if override.key_or_group == "norm" else ""
                fail(
                    f"unknown {override.key_or_group} '{choice}': choose one of {', '.join(valid)} "
                    f"(conf/{override.key_or_group}/{yours}{own})"
                )
    flags = [arg for arg in args if arg.startswith("-")]
    if unknown := [flag for flag in flags if flag.split("=")[0] not in HYDRA_FLAGS]:
        fail(f"unrecognized arguments: {' '.join(unknown)} (--help lists the options)")
    if set(flags) - {"-m", "--multirun"}:  # help, completion, --cfg, another config...: Hydra answers those itself
        return
    overrides = [arg for arg in args if arg not in flags]
    for arg in overrides:
        try:
            parser.parse_overrides([arg])
        except OverrideParseException:
            fail(f"cannot read '{arg}' as a setting: give key=value (--help lists the keys; lists, sweeps and "
                 "quoting: https://hydra.cc/docs/advanced/override_grammar/basic)")
    if flags:  # a sweep: compose its first job (a sweep's other values are choices checked above, or plain values)
        overrides = [first_job(override) for override in overrides]
    try:
        compose(config_name, overrides)
    except HydraException as e:
        fail(" ".join(line.strip() for line in str(e).splitlines() if line.strip()) + " (--help shows the config)")


def user_config_folders(args: list[str]) -> list[Path]:
    """The config folders that the command line adds to normlab's (a user's conf/norm/<name>.yaml lives there): those
    of hydra.searchpath=[file://DIR,...] (pkg://PACKAGE: the package's folder) and of --config-dir DIR."""
    folders = []
    for i, arg in enumerate(args):
        if arg in ("-cd", "--config-dir") and i + 1 < len(args):
            folders.append(Path(args[i + 1]))
        elif arg.startswith("--config-dir="):
            folders.append(Path(arg.split("=", 1)[1]))
        elif arg.lstrip("+").startswith("hydra.searchpath="):
            try:
                (override,) = OverridesParser.create().parse_overrides([arg])
            except OverrideParseException:
                continue
            entries = override.value() if isinstance(override.value(), list) else [override.value()]
            for entry in map(str, entries):
                if entry.startswith("file://"):
                    folders.append(Path(entry.removeprefix("file://")))
                elif entry.startswith("pkg://") and (spec := importlib.util.find_spec(entry[6:].replace("/", "."))):
                    folders += [Path(p) for p in spec.submodule_search_locations or []]
    return folders


# Hydra 1.3's command-line options (hydra --help): anything else that starts with '-' is a mistake
HYDRA_FLAGS = {"-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "--resolve", "-p", "--package", "-r",
               "--run", "-m", "--multirun", "-sc", "--shell-completion", "-cp", "--config-path", "-cn",
               "--config-name", "-cd", "--config-dir", "--experimental-rerun", "-i", "--info"}


HELP_AND_COMPLETION_FLAGS = {"-h", "--help", "-sc", "--shell-completion"}


def without_foreign_groups(answer: str, config_name: str) -> str:
    """Hydra's --help and shell completion offer every group folder of conf/; keep only the groups that this command
    composes (normlab-angles: probe and paths, not model or data): help lines `group: options`, completion words
    `group=...`, `group.` and `group/...`."""
    choices = compose(config_name, with_hydra=True).hydra.runtime.choices
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in ("hydra", "__pycache__")}
    foreign = groups - set(choices)
    if not foreign:
        return answer
    if "== Configuration groups ==" in answer:  # --help
        head, groups, tail = re.split(r"(?s)(== Configuration groups ==.*?)(?=== Config ==)", answer, maxsplit=1)
        own = [line for line in groups.splitlines(keepends=True) if line.split(": ")[0] not in foreign]
        return head + ("".join(own) if any(re.match(r"\w+: ", line) for line in own) else "") + tail
    return re.sub(r"[ \t]*(?<!\S)(" + "|".join(sorted(foreign)) + r")[=./]\S*", "", answer).lstrip(" ")


def first_job(arg: str) -> str:
    """The override as the first job of a -m sweep runs it (a sweep of choices or values: its first value)."""
    (override,) = OverridesParser.create().parse_overrides([arg])
    if not override.is_sweep_override():
        return arg
    try:
        first = next(iter(override.sweep_string_iterator()))
    except (HydraException, StopIteration):  # a range() or interval sweep: leave it to Hydra's sweeper
        return arg
    prefix = "+" if override.is_add() else "++" if override.is_force_add() else ""
    return f"{prefix}{override.key_or_group}={first}"


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


class OneJobPerOut(Callback):
    """A Hydra callback of the commands whose out= names one output (a file, or a folder that a job replaces): a -m
    sweep of several jobs with it, each writing the same out=, is refused in one line before any job runs. `keys`:
    only a sweep over these counts (normlab-angles and normlab-ablate: model_path; their jobs of one model add rows
    to one CSV); None: any. `default_outputs` says where each job's output goes without out=."""

    def __init__(self, default_outputs: str, keys: list[str] | None = None):
        self.default_outputs, self.keys = default_outputs, keys

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        keys = [k for k in swept(config.hydra.overrides.task) if self.keys is None or k in self.keys]
        if config.out is not None and keys:
            fail(f"out= names one output, but {keys[0]} is swept (each job would write it): give one {keys[0]} "
                 f"with it, or leave out out= ({self.default_outputs})")


def swept(overrides) -> dict[str, list[str]]:
    """The keys that the overrides sweep (several values), each with its values in order; a later override of a key
    replaces an earlier one."""
    values: dict[str, list[str]] = {}
    for arg in overrides:
        try:
            (override,) = OverridesParser.create().parse_overrides([arg])
        except OverrideParseException:
            continue
        key = override.get_key_element()
        values[key] = list(override.sweep_string_iterator()) if override.is_sweep_override() else []
    return {k: v for k, v in values.items() if len(v) > 1}


def jobs_not_run(rerun_hint: str | None) -> str:
    """'; jobs not run: ...' for a -m sweep stopped in its current job: the jobs after it, in the order Hydra's basic
    sweeper runs them (the product of the swept values, sweeper params first), each by its swept values, and
    `rerun_hint` in brackets."""
    config = HydraConfig.get()
    if config.mode != RunMode.MULTIRUN:
        return ""
    params = [f"{k}={v}" for k, v in (config.sweeper.get("params") or {}).items()]
    values = swept(params + [a for a in sys.argv[1:] if not a.startswith("-")])
    jobs = [" ".join(f"{k}={v}" for k, v in zip(values, job)) for job in itertools.product(*values.values())]
    later = jobs[config.job.num + 1 :]
    return f"; jobs not run: {', '.join(later)}{f' ({rerun_hint})' if rerun_hint else ''}" if later else ""


def hydra_app(config_name: str, rerun_hint: str | None = None):
    """Turn `task(cfg)` into a console-script entry point over conf/<config_name>.yaml; `rerun_hint`: what to do
    about the jobs that a -m sweep stopped by an error did not run."""
    # Here rather than in main: a job that Hydra's submitit launcher runs on another node resolves the config in a
    # process that unpickles the task, which imports this module, and calls no main
    register_resolvers()

    def decorate(task):
        @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)
        def run(cfg: DictConfig):
            try:
                return task(cfg)
            except NormlabError as e:
                if isinstance(e, Interrupted) and process_rank():
                    sys.exit(e.exit_code)  # rank 0 says it
                program = f"normlab-{config_name}"  # the command's name also in a submitit job (argv: _submit.py)
                if isinstance(e, Interrupted):
                    requeue_with_submitit(e, f"{program}: {e}")
                fail(f"{e}{jobs_not_run(rerun_hint)}", e.exit_code, program)

        def main():
            sys.argv[1:] = current_overrides(sys.argv[1:])  # model.lr=, callbacks.scheduled_checkpoints.*= of old
            check_command_line(config_name, sys.argv[1:])
            if not set(sys.argv[1:]) & HELP_AND_COMPLETION_FLAGS:
                return run()
            answer = io.StringIO()
            try:
                with contextlib.redirect_stdout(answer):
                    run()
            finally:
                print(without_foreign_groups(answer.getvalue(), config_name), end="")

        main.__doc__ = task.__doc__
        return main

    return decorate


@hydra_app("train", rerun_hint="run the same command again: finished runs are skipped")
def train(cfg: DictConfig) -> None:
    """Train one model; resumes from the newest intact checkpoint of its run directory when there is one."""
    from normlab.training import pipeline

    install_signal_handlers()  # from here on SIGTERM, SIGUSR1 and Ctrl-C stop the run (or sweep), its progress saved
    pipeline.train(cfg, micro_batch=auto_micro_batch)


def auto_micro_batch(cfg: DictConfig, model) -> str:
    """data.batch_size=auto, resolved by the resource plan for the GPU this process trains on (cluster/plan.py)."""
    from normlab.cluster import plan

    return plan.resolve_micro_batch(cfg, model, plan.this_gpu(cfg))


@hydra_app("prepare")
def prepare(cfg: DictConfig) -> None:
    """Tokenize the corpus of `data=` into data/<name>/."""
    from normlab.data.prepare import prepare as prepare_data

    prepare_data(cfg.data, num_proc=cfg.num_proc, ranks_file=cfg.tokenizer_ranks_file)


@hydra_app("angles")
def angles(cfg: DictConfig) -> None:
    """Angle statistics (angles.csv) of `model_path`: a run directory, a checkpoint or a Hugging Face model."""
    from normlab.study.angles import main as measure_angles

    measure_angles(cfg)


@hydra_app("report")
def report(cfg: DictConfig) -> None:
    """Loss and angle figures and summary.md of the normlab runs in `runs`, LN and RMS side by side."""
    from normlab.study.report import main as write_report

    write_report(cfg)


@hydra_app("describe")
def describe(cfg: DictConfig) -> None:
    """Parameter counts and training FLOPs per token of `model=` with `norm=`, on the meta device, and the resource
    plan for the GPUs of plan.gpus (normlab/cluster/plan.py)."""
    import torch

    from normlab.cluster import plan
    from normlab.training.pipeline import build_model

    with torch.device("meta"):
        model = build_model(cfg)
    chosen = ""
    if cfg.data.batch_size == "auto":  # as normlab-train would choose it on the first GPU of plan.gpus
        chosen = f"{plan.resolve_micro_batch(cfg, model, plan.gpus_of(cfg)[0])}\n"
    resources = chosen + plan.render(cfg, model)  # first: a bad plan.gpus is refused before anything is printed
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
    print(f"\n{resources}")


@hydra_app("ablate")
def ablate(cfg: DictConfig) -> None:
    """Mean-subtraction ablation (ablation.csv) of `model_path`: a run directory, a checkpoint or a Hugging Face
    model."""
    from normlab.study.ablate import main as measure_ablation

    measure_ablation(cfg)


@hydra_app("export")
def export(cfg: DictConfig) -> None:
    """A normlab checkpoint (or a run's newest) as a Hugging Face model directory with GPT-2 tokenizer files."""
    from normlab.interop.export import main as export_model

    export_model(cfg)


@hydra_app("sample")
def sample(cfg: DictConfig) -> None:
    """Text generated by a normlab checkpoint (or a run's newest) from a prompt; deterministic for a seed."""
    from normlab.interop.sample import main as generate

    generate(cfg)


@hydra_app("eval")
def evaluate(cfg: DictConfig) -> None:
    """lm-evaluation-harness tasks and held-out perplexity of a checkpoint, a run or every run of a sweep."""
    from normlab.interop.evaluate import main as run_evaluation

    run_evaluation(cfg)


@hydra_app("convert")
def convert(cfg: DictConfig) -> None:
    """A LayerNorm model (normlab checkpoint, run or Hugging Face GPT-2) as an RMSNorm run computing the same
    function."""
    from normlab.interop.convert import main as convert_model

    convert_model(cfg)
