"""normlab-angles (conf/angles.yaml): the angle statistics of the probe (normlab.probe) for saved normlab
checkpoints (every intact scheduled checkpoint of a run directory, or one .ckpt) and for local Hugging Face model
directories (interop.pretrained), appended to a CSV that any number of models share (probe.table's columns)."""

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from tqdm import tqdm

from normlab.common import outputs
from normlab.data.tokenizer import EOT
from normlab.interop import pretrained
from normlab.probe.hooks import measure
from normlab.probe.sites import norm_sites
from normlab.probe.table import CSV_COLUMNS, AnalysisError, is_angles_header, run_identity
from normlab.training import loader
from normlab.training.rundir.checkpoints import verify
from normlab.training.rundir.files import RunDirError, warn
from normlab.training.rundir.tables import read_table

COMMAND = "normlab-angles"


def append_csv(path: Path, records: list[dict]) -> None:
    """Add `records` to the CSV at `path`, which may hold the rows of any number of models: rows of the same source
    and step are replaced (measuring a checkpoint again rewrites its rows, without duplicates), every other row is
    kept; a torn or damaged row is dropped with a warning."""
    measured = {(str(r["source"]), str(r["step"])) for r in records}
    _, rows, dropped = read_table(path)
    if dropped:
        warn(f"{path}: dropped {dropped} torn or damaged row{'s' * (dropped > 1)}")
    kept = [row for row in rows if (row.get("source", ""), row["step"]) not in measured]
    outputs.write_csv(path, CSV_COLUMNS, kept + records, COMMAND, is_angles_header)


def check_positive(name: str, value, null_means: str | None = None) -> None:
    """A positive whole number (or null, when `null_means` says what null stands for)."""
    if value is None and null_means:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        or_null = f", or null for {null_means}" if null_means else ""
        raise AnalysisError(f"{name}={value}: give a positive whole number{or_null}")


def check_null_directions(value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise AnalysisError(f"probe.null_directions={value}: give a whole number of random directions (0: none)")


@dataclass
class Analysis:
    """A path given to normlab-angles, checked and ready to measure."""

    path: Path
    layout: str  # a key of probe.sites.LAYOUTS
    checkpoints: list[tuple[int, Callable[[], nn.Module], dict]]  # (step, what loads its model, identity), by step
    windows: torch.Tensor  # the probe: [sequences, seq_len] token ids
    warnings: list[str]
    separator: int  # the token id between the probe's documents: position first is the token after it


def checked_seq_len(cfg: DictConfig, path: Path, context: int, context_name: str) -> int:
    """seq_len (null: the model's context, at most 1024), checked against the context and probe.tokens."""
    seq_len = cfg.seq_len or min(1024, context)
    if seq_len > context:
        raise AnalysisError(
            f"seq_len={seq_len} is beyond the context of {path} ({context} tokens, {context_name}): "
            f"give at most {context}"
        )
    if cfg.probe.tokens is not None and cfg.probe.tokens < seq_len:
        raise AnalysisError(
            f"probe.tokens={cfg.probe.tokens} is less than one sequence of {seq_len} tokens: give at least "
            f"{seq_len}, a smaller seq_len, or probe.tokens=null for the whole split"
        )
    return seq_len


def plan_hugging_face(path: Path, cfg: DictConfig) -> Analysis:
    """A local Hugging Face model directory, its probe windows in the model's own tokens."""
    from normlab.data.corpus import load_probe

    model_type, config = pretrained.model_config(path)
    seq_len = checked_seq_len(cfg, path, *pretrained.context(config))
    probe = load_probe(cfg.probe.dir, cfg.probe.split, cfg.probe.tokens, seq_len)
    windows, separator = pretrained.hf_windows(path, probe, config.vocab_size, seq_len)
    step, identity = pretrained.identity(path, model_type, config)
    load = partial(pretrained.load_hugging_face, path, cfg.get("dtype", "float32"))
    return Analysis(path, model_type, [(step, load, identity)], windows, [], separator)


def normlab_probe(checkpoint: Path, path: Path, cfg: DictConfig) -> tuple[dict, torch.Tensor]:
    """The run config a normlab checkpoint carries, and the probe windows of `cfg` for its model (seq_len checked
    against its context; `path`: what the user named, for the error)."""
    from normlab.data.corpus import load_probe

    config = loader.saved_config(loader.read_checkpoint(checkpoint))
    seq_len = checked_seq_len(cfg, path, config["model"]["block_size"], "model.block_size")
    return config, load_probe(cfg.probe.dir, cfg.probe.split, cfg.probe.tokens, seq_len, config["model"]["vocab_size"])


def plan_normlab(path: Path, cfg: DictConfig) -> Analysis:
    """A checkpoint, or every intact scheduled checkpoint of a run directory (damaged ones: a warning each)."""
    is_run = path.is_dir()
    checkpoints = sorted((path / "checkpoints").glob("step-*.ckpt")) if is_run else [path]
    if not checkpoints:
        raise AnalysisError(
            f"no checkpoint (.ckpt or <run>/checkpoints/step-*.ckpt) at {path}: give a .ckpt, a run "
            "directory or a Hugging Face model directory (with its config.json)"
        )
    intact, damaged = [], []
    for checkpoint in checkpoints:
        try:
            intact.append((verify(checkpoint).step, checkpoint))
        except RunDirError as e:
            if not is_run:
                raise AnalysisError(f"{e}: give another checkpoint of the run, or the run directory") from None
            damaged.append(str(e))
    if not intact:
        more = f" (and {len(damaged) - 1} more damaged)" if len(damaged) > 1 else ""
        raise AnalysisError(
            f"no intact checkpoint in {path / 'checkpoints'}: {damaged[0]}{more}; restore them from a "
            "copy, or train the run again"
        )
    config, windows = normlab_probe(intact[0][1], path, cfg)
    return Analysis(
        path,
        "normlab",
        [(step, partial(loader.load_model, c, cfg.get("dtype", "float32")), run_identity(config, str(c.resolve())))
         for step, c in sorted(intact)],
        windows,
        [f"{reason}: skipped" for reason in damaged],
        EOT,
    )


def plan(path: Path, cfg: DictConfig) -> Analysis:
    if not path.exists():
        raise AnalysisError(f"{path} does not exist: give a .ckpt, a run directory or a Hugging Face model directory")
    if (path / "config.json").is_file():
        return plan_hugging_face(path, cfg)
    return plan_normlab(path, cfg)


def measure_analysis(analysis: Analysis, device: str, batch_size: int, null_directions: int = 0) -> list[dict]:
    """The angle rows of every checkpoint of `analysis`, loading one model at a time."""
    batches = [
        (b.to(device), torch.ones_like(b, dtype=torch.bool, device=device)) for b in analysis.windows.split(batch_size)
    ]
    records = []
    for step, load, identity in analysis.checkpoints:  # one model in memory at a time
        model = load().to(device).eval()
        if analysis.layout == "normlab":
            d, forward = model.config.n_embd, lambda ids, mask, m=model: m.hidden(ids)
        else:
            d = model.config.hidden_size
            forward = lambda ids, mask, m=model: m.base_model(input_ids=ids, attention_mask=mask)  # noqa: E731
        progress = tqdm(batches, desc=f"{analysis.path.name} step {step}", unit="batch")
        stats = measure(forward, norm_sites(model, analysis.layout), d, progress, device, null_directions,
                        analysis.separator)
        records += stats.records(step, pretrained.with_norm(identity, model, analysis.layout))
        del model, forward
    return records


def default_name(path: Path) -> str:
    """<folder>/<name>.csv of what is measured: a run as <experiment>/<run>.csv, a checkpoint as
    <experiment>/<run>-<checkpoint>.csv, a Hugging Face model as <its folder>/<model>.csv; rows also carry their source,
    so that even two inputs of the same name share a file without losing rows."""
    path = path.resolve()
    if path.is_file() and path.parent.name == "checkpoints":
        run = path.parent.parent
        return f"{run.parent.name}/{run.name}-{path.stem}.csv"
    return f"{path.parent.name}/{path.stem if path.is_file() else path.name}.csv"


def main(cfg: DictConfig) -> None:
    """normlab-angles (normlab.cli.angles): the angle rows of every intact checkpoint of a run directory, of one
    checkpoint, or of a Hugging Face model directory (`model_path`), on the probe set of `probe=`, into `out`."""
    if OmegaConf.is_missing(cfg, "model_path") or not str(cfg.model_path).strip():
        raise AnalysisError("no model given: model_path=RUN_DIR, model_path=CHECKPOINT.ckpt or "
                            "model_path=HF_MODEL_DIR")
    path = Path(str(cfg.model_path))
    check_positive("seq_len", cfg.seq_len, "the model's context")
    check_positive("probe.tokens", cfg.probe.tokens, "the whole split")
    check_positive("probe.batch_size", cfg.probe.batch_size)
    check_null_directions(cfg.probe.null_directions)
    loader.check_dtype(cfg.dtype, AnalysisError)
    device = loader.device_name(cfg.device, AnalysisError)
    out = Path(str(cfg.out or Path(cfg.paths.output_dir) / "angles" / default_name(path)))
    try:  # a new file, or an earlier output of normlab-angles (its header): rows of other models are kept
        outputs.check_file(out, COMMAND, is_angles_header, example="angles.csv")
    except outputs.OutputError as e:
        raise AnalysisError(str(e)) from None
    analysis = plan(path, cfg)  # checked before any model runs
    for warning in analysis.warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    records = measure_analysis(analysis, device, cfg.probe.batch_size, cfg.probe.null_directions or 0)
    append_csv(out, records)  # written once measured: a failure leaves no partial output
    count = len(analysis.checkpoints)
    print(f"wrote {out} ({count} checkpoint{'s' * (count > 1)}, {analysis.windows.numel():,} probe tokens)")
