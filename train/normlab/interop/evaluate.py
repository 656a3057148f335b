"""normlab-eval: a normlab checkpoint on lm-evaluation-harness tasks and on held-out perplexity (docs/evaluate.md).

Harness tasks run through lm-eval's own Hugging Face backend (HFLM) over the checkpoint converted in memory by
interop.export.hugging_face. A task named perplexity_<data> is normlab's own: the token-level cross-entropy of the
model on the prepared data/<data>/ held-out split (val, or probe for a probe set such as wikipedia), in windows of
the model's full context, each token predicted once (as normlab-train's validation does). The rows go to
results.csv and results.md (rows of other runs, tasks and steps already there kept) and to the run's own wandb run.
"""

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from filelock import FileLock
from omegaconf import DictConfig, OmegaConf

from normlab.common import outputs
from normlab.common.errors import NormlabError
from normlab.probe.table import IDENTITY_COLUMNS, DamagedTable, read_rows, run_identity
from normlab.training import loader

COMMAND = "normlab-eval"
CSV_COLUMNS = (*IDENTITY_COLUMNS, "step", "task", "metric", "value", "stderr", "count", "num_fewshot")
KEY_COLUMNS = ("run", "source", "step", "task", "metric")  # a new row replaces the old row of the same key
PERPLEXITY = "perplexity_"  # perplexity_<data>: normlab's held-out perplexity of data/<data>/
HELD_OUT_SPLITS = ("val", "probe")  # a training corpus's held-out split, else a probe set's


class EvalError(NormlabError):
    """An evaluation that cannot run as asked."""


@dataclass
class Subject:
    """The checkpoint to evaluate, the columns that name it, its run directory (None for a .ckpt of no run) and
    where its results go unless out= says otherwise."""

    checkpoint: Path
    names: dict  # IDENTITY_COLUMNS and step
    run_dir: Path | None
    out: Path
    warnings: list[str] = field(default_factory=list)


def plan(path: Path) -> Subject:
    checkpoint, step, warnings = loader.chosen(path, EvalError)
    checkpoint = checkpoint.resolve()
    in_run = checkpoint.parent.name == "checkpoints" and (checkpoint.parent.parent / "config.yaml").is_file()
    run_dir = checkpoint.parent.parent if in_run else None
    config = loader.saved_config(loader.read_checkpoint(checkpoint))
    names = {**run_identity(config, str(checkpoint)), "step": step}
    if run_dir is not None:
        names["run"] = run_dir.name  # the directory's name, as normlab-ablate's rows
    return Subject(checkpoint, names, run_dir, (run_dir or checkpoint.parent) / "eval", warnings)


# -- held-out perplexity (perplexity_<data>)


def held_out_split(name: str, data_dir: Path, vocab_size: int) -> tuple[Path, str]:
    """The prepared folder and held-out split of perplexity_<name>, checked."""
    from normlab.data.corpus import verify_prepared

    folder = data_dir / name
    if not name or not (folder / "meta.json").is_file():
        prepared = sorted(p.parent.name for p in data_dir.glob("*/meta.json"))
        raise EvalError(f"task {PERPLEXITY}{name}: data/{name} is not prepared (no {folder / 'meta.json'}): run "
                        f"normlab-prepare data={name or '<name>'}, or choose one of "
                        f"{', '.join(PERPLEXITY + p for p in prepared) or 'none prepared here'}")
    meta = verify_prepared(folder, name, None, vocab_size, (), checksums=False)
    split = next((s for s in HELD_OUT_SPLITS if s in meta["splits"]), None)
    if split is None:
        raise EvalError(f"task {PERPLEXITY}{name}: {folder} has no held-out split ({' or '.join(HELD_OUT_SPLITS)}; "
                        f"it has {', '.join(meta['splits'])}): prepare it again with normlab-prepare data={name}")
    verify_prepared(folder, name, None, vocab_size, (split,), checksums=False)
    return folder, split


def held_out_windows(folder: Path, split: str, tokens: int | None, context: int) -> torch.Tensor:
    """[windows, context + 1]: the first windows of the split, each overlapping the next by one token so that every
    token after the first is predicted once; as many as `tokens` predicted tokens allow (None: all)."""
    from normlab.data.prepare import META_FILE

    file = folder / json.loads((folder / META_FILE).read_text())["splits"][split]["file"]
    stream = np.memmap(file, dtype=np.uint16, mode="r")
    windows = (len(stream) - 1) // context
    if tokens is not None:
        windows = min(windows, tokens // context)
    ids = torch.from_numpy(stream[: windows * context + 1].astype(np.int64))
    return ids.unfold(0, context + 1, context)


@torch.no_grad()
def window_losses(model: torch.nn.Module, windows: torch.Tensor, batch_size: int, device: str) -> torch.Tensor:
    """[windows] float64: the mean next-token cross-entropy (nats) of each window, computed in float32."""
    model = model.to(device).eval()
    losses = []
    for batch in windows.split(batch_size):
        batch = batch.to(device)
        logits = model(batch[:, :-1]).float()
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="none")
        losses.append(loss.view(len(batch), -1).double().mean(1).cpu())
    return torch.cat(losses)


def perplexity_rows(model: torch.nn.Module, task: str, windows: torch.Tensor, batch_size: int,
                    device: str) -> list[dict]:
    losses = window_losses(model, windows, batch_size, device)
    loss = losses.mean().item()
    stderr = (losses.std() / math.sqrt(len(losses))).item() if len(losses) > 1 else ""
    count = windows.shape[0] * (windows.shape[1] - 1)
    return [{"task": task, "metric": "loss", "value": loss, "stderr": stderr, "count": count, "num_fewshot": ""},
            {"task": task, "metric": "perplexity", "value": math.exp(loss), "stderr": "", "count": count,
             "num_fewshot": ""}]


# -- lm-evaluation-harness tasks


def task_manager(include_path: list[str]):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path or None)


def task_problem(name: str, error: Exception) -> str:
    """What is wrong with a harness task that cannot be loaded, and what to do, in one line."""
    from datasets import config as datasets_config

    if isinstance(error, KeyError) and "not a registered" in str(error):
        return (f"unknown task '{name}': lm-eval ls tasks lists the harness's tasks; tasks of your own: "
                f"include_path=[FOLDER_OF_YAMLS]; held-out perplexity: {PERPLEXITY}<data>")
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, (ConnectionError, OSError)) or "offline" in reason.lower():
        return (f"task {name}: its dataset is not in the datasets cache {datasets_config.HF_DATASETS_CACHE} and "
                f"cannot be downloaded here ({reason}): download it once on a machine with network (the login node) "
                f"into the same HF_DATASETS_CACHE, e.g. normlab-eval model_path=... tasks=[{name}] limit=1 "
                "(docs/evaluate.md)")
    return f"task {name} cannot be loaded ({type(error).__name__}: {reason})"


def check_tasks(names: list[str], manager) -> None:
    """Each harness task loads (its dataset cached or downloaded), else an EvalError naming the first that does
    not."""
    for name in names:
        try:
            manager.load([name])
        except Exception as e:  # noqa: BLE001 (lm-eval and datasets raise KeyError, ConnectionError, ValueError...)
            raise EvalError(task_problem(name, e)) from None


def metric_rows(results: dict) -> list[dict]:
    """lm-eval's results as rows: one per task (or group) and metric; a filter other than `none` is named in the
    metric (exact_match/strict-match)."""
    rows = []
    for task, values in results["results"].items():
        samples = results.get("n-samples", {}).get(task, {}).get("effective", "")
        shots = results.get("n-shot", {}).get(task, "")
        for key, value in values.items():
            metric, comma, filter_name = key.partition(",")  # metric keys are "<metric>,<filter>"; alias, ... not
            if not comma or "_stderr" in metric or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            stderr = values.get(f"{metric}_stderr,{filter_name}")
            rows.append({"task": task, "metric": metric if filter_name in ("", "none") else f"{metric}/{filter_name}",
                         "value": value, "stderr": stderr if isinstance(stderr, (int, float)) else "",
                         "count": samples, "num_fewshot": shots})
    return rows


def harness_rows(checkpoint: Path, names: list[str], cfg: DictConfig, device: str) -> list[dict]:
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from transformers.utils import logging as transformers_logging

    from normlab.interop.export import hugging_face

    transformers_logging.disable_progress_bar()  # "Loading weights": an error below stays one line on stderr
    manager = task_manager([str(p) for p in cfg.include_path])
    model, tokenizer = hugging_face(checkpoint, cfg.dtype)
    lm = HFLM(pretrained=model.to(device), tokenizer=tokenizer, batch_size=cfg.batch_size,
              max_length=model.config.n_positions)
    try:
        results = lm_eval.simple_evaluate(model=lm, tasks=names, num_fewshot=cfg.num_fewshot, limit=cfg.limit,
                                          task_manager=manager, log_samples=False)
    except Exception:
        check_tasks(names, manager)  # a task that cannot be loaded (not cached, offline): say which, in one line
        raise
    return metric_rows(results)


# -- results.csv, results.md and wandb


def key(row: dict) -> tuple:
    return tuple(str(row[c]) for c in KEY_COLUMNS)


def merged_rows(path: Path, rows: list[dict]) -> list[dict]:
    """The rows of `path` that `rows` do not replace, then `rows`."""
    if not path.is_file():
        return rows
    try:
        old = read_rows(path, lambda column, value: value, KEY_COLUMNS)
    except DamagedTable as e:
        raise EvalError(f"{e}: move it aside, or delete it, and evaluate again") from None
    new = {key(r) for r in rows}
    return [r for r in old if key(r) not in new] + rows


def number(value, digits: int = 4) -> str:
    try:
        return f"{float(value):.{digits}f}"
    except (TypeError, ValueError):
        return "—"


MARKDOWN_TITLE = "# Evaluation (normlab-eval)"
MARKDOWN_NOTE = ("\n\nstderr: of the mean over examples (harness tasks) or over windows (perplexity loss); count: "
                 "examples scored, or tokens predicted for perplexity_<data>.\n")


def markdown(rows: list[dict]) -> str:
    lines = [f"{MARKDOWN_TITLE}\n", "| run | norm | seed | step | task | metric | value | ± stderr | count | "
             "few-shot |", "|---|---|---:|---:|---|---|---:|---:|---:|---:|"]
    order = sorted(rows, key=lambda r: (str(r["run"]), int(r["step"]), str(r["task"]), str(r["metric"])))
    for r in order:
        lines.append(f"| {r['run']} | {r['norm']} | {r['seed']} | {r['step']} | {r['task']} | {r['metric']} | "
                     f"{number(r['value'])} | {number(r['stderr'])} | {r['count']} | {r['num_fewshot']} |")
    return "\n".join(lines) + MARKDOWN_NOTE


def is_results_header(line: str) -> bool:
    return line == ",".join(CSV_COLUMNS)


def is_markdown_title(line: str) -> bool:
    return line == MARKDOWN_TITLE


def check_out(out: Path) -> None:
    """Before anything runs: `out` is a folder, in a run directory only its eval/, where results.csv and results.md
    are new or earlier outputs of normlab-eval (their first lines); nothing else in it is touched (outputs.py)."""
    if out.exists() and not out.is_dir():
        raise EvalError(f"out={out} is a file: give a folder (results.csv and results.md go into it)")
    try:
        outputs.check_place(out, COMMAND, owned_in_run=("eval",))
        outputs.check_file(out / "results.csv", COMMAND, is_results_header, owned_in_run=("eval",))
        outputs.check_file(out / "results.md", COMMAND, is_markdown_title, owned_in_run=("eval",))
    except outputs.OutputError as e:
        raise EvalError(str(e)) from None


def write_results(out: Path, rows: list[dict]) -> list[dict]:
    """Merge `rows` into out/results.csv and rewrite out/results.md; all rows of the folder."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with FileLock(out / ".results.lock"):  # jobs of a sweep launched in parallel may share one out
            rows = merged_rows(out / "results.csv", rows)
            outputs.write_csv(out / "results.csv", CSV_COLUMNS, rows, COMMAND, is_results_header,
                              extrasaction="ignore")
            outputs.write_output(out / "results.md", markdown(rows), COMMAND, is_markdown_title)
    except outputs.OutputError as e:
        raise EvalError(str(e)) from None
    except OSError as e:
        raise EvalError(f"cannot write {out} ({e.strerror}): give a writable out=") from None
    return rows


def wandb_settings(subject: Subject, wanted: bool) -> dict | None:
    """The wandb run of the subject's run directory (its config's logger.wandb, id from run_id), or None: not
    wanted, no run directory, trained without wandb, or WANDB_MODE=disabled."""
    from normlab.common.run_identity import run_id

    mode = os.environ.get("WANDB_MODE", "offline")
    if not wanted or subject.run_dir is None or mode == "disabled":
        return None
    logger = OmegaConf.select(OmegaConf.load(subject.run_dir / "config.yaml"), "logger.wandb")
    identifier = run_id(str(subject.run_dir))
    if logger is None or identifier is None:
        return None
    return {"project": logger.get("project"), "entity": logger.get("entity"), "group": logger.get("group"),
            "name": logger.get("name"), "id": identifier, "dir": str(subject.run_dir), "mode": mode}


NUMBER_COLUMNS = {"seed", "step", "value", "stderr", "count", "num_fewshot"}


def cell(column: str, value):
    """A value of a row (read back from the CSV as text, or new) as one type per wandb table column."""
    if column not in NUMBER_COLUMNS:
        return str(value)
    return None if value in ("", None) else float(value)


def log_to_wandb(settings: dict, rows: list[dict]) -> None:
    """Summary values eval/<task>/<metric> (each at the newest step evaluated) and a table of every row."""
    import wandb

    rows = sorted(rows, key=lambda r: int(r["step"]))
    run = wandb.init(**settings, resume="allow", settings=wandb.Settings(quiet=True, silent=True))
    run.summary.update({f"eval/{r['task']}/{r['metric']}": float(r["value"]) for r in rows})
    data = [[cell(column, r[column]) for column in CSV_COLUMNS] for r in rows]
    run.log({"eval/results": wandb.Table(columns=list(CSV_COLUMNS), data=data)})
    run.finish()
    # finish() can return before wandb-core has written the run's records (seen offline under load, wandb 0.31):
    # teardown waits for the service to flush and stop, so that the results are on disk when this returns
    wandb.teardown()


# -- the command (conf/eval.yaml)


def check_options(cfg: DictConfig) -> None:
    def whole(name: str, value, least: int, null_means: str | None) -> None:
        if value is None and null_means:
            return
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            or_null = f", or null for {null_means}" if null_means else ""
            raise EvalError(f"{name}={value}: give a whole number from {least}{or_null}")

    whole("limit", cfg.limit, 1, "all examples")
    whole("num_fewshot", cfg.num_fewshot, 0, "each task's default")
    whole("batch_size", cfg.batch_size, 1, None)
    whole("perplexity.tokens", cfg.perplexity.tokens, 1, "the whole split")
    loader.check_dtype(cfg.dtype, EvalError)
    for folder in cfg.include_path:
        if not Path(str(folder)).is_dir():
            raise EvalError(f"include_path: {folder} is not a folder: give folders of task YAML files")


def task_names(value) -> list[str]:
    names = [str(t) for t in value] if OmegaConf.is_list(value) else [str(value)] if value else []
    if not names:
        raise EvalError(f"no task given: tasks=[lambada_openai,hellaswag] (harness tasks) and {PERPLEXITY}<data> "
                        "(held-out perplexity)")
    return list(dict.fromkeys(names))


def main(cfg: DictConfig) -> None:
    """normlab-eval (normlab.cli.evaluate): the harness tasks and held-out perplexities of `tasks` for `model_path`,
    into `out` (conf/eval.yaml)."""
    if OmegaConf.is_missing(cfg, "model_path") or not str(cfg.model_path).strip():
        raise EvalError("no model given: model_path=RUN_DIR or model_path=CHECKPOINT.ckpt")
    names = task_names(cfg.tasks)
    check_options(cfg)
    device = loader.device_name(cfg.device, EvalError)
    if cfg.out is not None:
        check_out(Path(str(cfg.out)))
    subject = plan(Path(str(cfg.model_path)))
    config = loader.saved_config(loader.read_checkpoint(subject.checkpoint))
    context = config["model"]["block_size"]
    held_out = {n: held_out_split(n.removeprefix(PERPLEXITY), Path(cfg.paths.data_dir), config["model"]["vocab_size"])
                for n in names if n.startswith(PERPLEXITY)}  # checked before anything runs
    if held_out and cfg.perplexity.tokens is not None and cfg.perplexity.tokens < context:
        raise EvalError(f"perplexity.tokens={cfg.perplexity.tokens} is less than one window of the model's "
                            f"context ({context} tokens): give at least that many, or null for the whole split")
    out = Path(str(cfg.out)) if cfg.out is not None else subject.out
    check_out(out)
    for warning in subject.warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    harness_tasks = [n for n in names if n not in held_out]
    rows = harness_rows(subject.checkpoint, harness_tasks, cfg, device) if harness_tasks else []
    if held_out:
        model = loader.load_model(subject.checkpoint, cfg.dtype)
        for name, (folder, split) in held_out.items():
            windows = held_out_windows(folder, split, cfg.perplexity.tokens, context)
            rows += perplexity_rows(model, name, windows, cfg.batch_size, device)
    rows = [{**subject.names, **row} for row in rows]
    every = write_results(out, rows)
    if settings := wandb_settings(subject, cfg.wandb):
        log_to_wandb(settings, [r for r in every if r["run"] == subject.names["run"]])
    names_text = f"{subject.names['run']} step {subject.names['step']}"
    for row in rows:
        stderr = f" ± {row['stderr']:.4f}" if isinstance(row["stderr"], float) else ""
        print(f"{names_text}: {row['task']} {row['metric']} {row['value']:.4f}{stderr}")
    print(f"wrote {out / 'results.csv'} and results.md ({len(rows)} rows of {len(names)} tasks; {len(every)} in all)")
