"""normlab-report runs=[RUN_OR_SWEEP_DIR,...]: figures and a summary of normlab runs, LN and RMS side by side.

Writes into <out> (default <first dir>/report): loss.png (training and validation loss); for runs with
angles.csv, angles_by_layer_<model>.png (per-layer angle to 1, a~ and b~ before and after the norms, mean +- std
at the last checkpoint, with the null band; the paper's figures 3, 4, 6-13) and angles_training_<run>.png (the
pre-norm angle of every layer across checkpoints; figures 14-37); summary.md with the tables. Prints the tables.
"""

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from normlab.angles import REFERENCES, AnalysisError, DamagedTable, read_csv, read_rows  # noqa: E402

NORM_COLORS = {"layernorm": "tab:blue", "rmsnorm": "tab:red"}
REFERENCE_LABELS = {
    "uniform": "uniform vector 1",
    "random_a": "random a~ (norm sqrt d)",
    "random_b": "random b~ (other norm)",
}
REFERENCE_COLORS = {"uniform": "tab:green", "random_a": "tab:purple", "random_b": "tab:orange"}


@dataclass
class Run:
    dir: Path
    config: dict
    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    angles: list[dict] = field(default_factory=list)

    @property
    def norm(self) -> str:
        return self.config["norm"]["name"]

    @property
    def label(self) -> str:
        return f"{self.config['model']['name']} {self.norm} seed {self.config['seed']}"

    def final(self, key: str) -> float:
        return self.metrics[key][-1][1] if self.metrics.get(key) else math.nan


RUN_CONFIG_KEYS = ("model.name", "norm.name", "seed")  # what the report reads of a run's config.yaml


def read_config(path: Path) -> dict:
    try:
        config = OmegaConf.load(path)
    except Exception as e:  # yaml's and OmegaConf's errors alike
        mark = getattr(e, "problem_mark", None)  # where yaml found the problem
        problem = f"line {mark.line + 1}: {e.problem}" if mark else str(e).strip().splitlines()[0]
        raise AnalysisError(
            f"{path} is not valid YAML ({problem}): restore it, or leave this run out of the report"
        ) from None
    missing = [k for k in RUN_CONFIG_KEYS if not isinstance(config, DictConfig) or OmegaConf.select(config, k) is None]
    if missing:
        raise AnalysisError(
            f"{path} is not a normlab run config (no {', '.join(missing)}): restore it, or leave this "
            "run out of the report"
        )
    return OmegaConf.to_container(config)


def metric_value(column: str, value: str) -> int | float | None:
    """A value of metrics.csv: the step, or a metric (None where the row does not log it)."""
    return int(value) if column == "step" else float(value) if value else None


def load_run(run_dir: Path) -> Run:
    run = Run(run_dir, read_config(run_dir / "config.yaml"))
    try:
        rows = read_rows(run_dir / "metrics.csv", metric_value)
    except DamagedTable as e:
        raise AnalysisError(f"{e}: rerun the same normlab-train command, which repairs it") from None
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "epoch") and value is not None:
                run.metrics.setdefault(key, []).append((row["step"], value))
    angles = run_dir / "angles.csv"
    if angles.is_file():
        try:
            run.angles = read_csv(angles)
        except DamagedTable as e:
            raise AnalysisError(
                f"{e}: rerun the same normlab-train command, which repairs it, or regenerate it with "
                f"normlab-angles model_path={run_dir} out={angles}"
            ) from None
    return run


def find_runs(paths: list[Path]) -> list[Run]:
    dirs = sorted(
        {m.parent for p in paths for m in ([p / "metrics.csv"] + sorted(p.glob("**/metrics.csv"))) if m.is_file()}
    )
    return [load_run(d) for d in dirs if (d / "config.yaml").is_file()]


def parameter_count(config: dict) -> int:
    from normlab.pipeline import build_model

    with torch.device("meta"):
        return build_model(OmegaConf.create(config)).num_params()


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_losses(runs: list[Run], path: Path) -> None:
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for run in runs:
        color = NORM_COLORS.get(run.norm)
        if run.metrics.get("train/loss"):
            steps, losses = zip(*run.metrics["train/loss"])
            ax_train.plot(steps, smooth(list(losses), 10), color=color, label=run.label, lw=1.2)
        if run.metrics.get("val/loss"):
            steps, losses = zip(*run.metrics["val/loss"])
            ax_val.plot(steps, losses, "o-", color=color, label=run.label, ms=3)
    ax_train.set(
        title="training loss (moving average of 10 steps)",
        xlabel="optimizer step",
        ylabel="cross-entropy (nats/token)",
    )
    ax_val.set(title="validation loss", xlabel="optimizer step")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def angle_rows(run: Run, site_suffix: str, step: int | None = None) -> list[dict]:
    """The run's angle rows (all positions) at `step` (default: its last) for sites ending in site_suffix."""
    step = max(r["step"] for r in run.angles) if step is None else step
    return [r for r in run.angles if r["step"] == step and r["position"] == "all" and r["site"].endswith(site_suffix)]


def null_band(ax, rows: list[dict]) -> None:
    if rows:
        std = rows[0]["null_std_deg"]
        ax.axhspan(90 - std, 90 + std, color="grey", alpha=0.2, lw=0, label="null: 90 ± (180/π)/√d")


def plot_angles_by_layer(runs: list[Run], path: Path) -> None:
    """Rows: norm input (pre) and output (post); columns: the three references; x: layer."""
    fig, axes = plt.subplots(2, 3, figsize=(14, 7), sharex=True, squeeze=False)
    for row, (io, io_label) in enumerate(
        (("input", "before the norm"), ("output", "after the norm (affine included)"))
    ):
        for col, reference in enumerate(REFERENCES):
            ax = axes[row][col]
            for k, run in enumerate(runs):
                rows = sorted(
                    (r for r in angle_rows(run, f".{io}") if r["reference"] == reference),
                    key=lambda r: (r["layer"], r["site"]),
                )
                x = [r["layer"] + (0.3 if r["site"].startswith("mlp") else 0.0) + 0.08 * k for r in rows]
                ax.errorbar(
                    x,
                    [r["mean_deg"] for r in rows],
                    yerr=[r["std_deg"] for r in rows],
                    fmt="o",
                    ms=3,
                    capsize=2,
                    color=NORM_COLORS.get(run.norm),
                    label=run.label,
                )
                if k == 0:
                    null_band(ax, rows)
            ax.set_title(f"{REFERENCE_LABELS[reference]}, {io_label}", fontsize=9)
            ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("layer (x.0 attention norm, x.3 MLP norm; last: final norm)")
    for ax in axes[:, 0]:
        ax.set_ylabel("angle (degrees), mean ± std")
    axes[0][0].legend(fontsize=7)
    step = max(r["step"] for r in runs[0].angles)
    fig.suptitle(
        f"{runs[0].config['model']['name']}: angle between hidden vectors and reference vectors, step {step:,}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_angles_training(run: Run, path: Path) -> None:
    """One panel per layer: the attention norm's input (the residual stream h) across checkpoints."""
    layers = sorted({r["layer"] for r in run.angles})
    cols = min(4, len(layers))
    fig, axes = plt.subplots(
        -(-len(layers) // cols), cols, figsize=(4 * cols, 2.8 * -(-len(layers) // cols)), squeeze=False, sharex=True
    )
    for ax, layer in zip(axes.flat, layers):
        site = "final_norm.input" if layer == layers[-1] else "attn_norm.input"
        for reference in REFERENCES:
            rows = sorted(
                (
                    r
                    for r in run.angles
                    if r["layer"] == layer
                    and r["site"] == site
                    and r["reference"] == reference
                    and r["position"] == "all"
                ),
                key=lambda r: r["step"],
            )
            ax.errorbar(
                [r["step"] for r in rows],
                [r["mean_deg"] for r in rows],
                yerr=[r["std_deg"] for r in rows],
                fmt="o-",
                ms=3,
                capsize=2,
                color=REFERENCE_COLORS[reference],
                label=REFERENCE_LABELS[reference],
            )
        null_band(ax, rows)
        ax.set_title(f"layer {layer} ({site.split('.')[0].replace('_', ' ')} input)", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(layers) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.supxlabel("training step")
    fig.supylabel("angle (degrees), mean ± std")
    fig.suptitle(f"{run.label}: hidden vectors before normalization, during training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def angle_table(runs: list[Run]) -> str:
    lines = [
        "| run | step | angle to 1 before the norms: layer means (min .. max) | largest std | null std |",
        "|---|---:|---:|---:|---:|",
    ]
    for run in runs:
        rows = [r for r in angle_rows(run, ".input") if r["reference"] == "uniform"] if run.angles else []
        if rows:
            means = [r["mean_deg"] for r in rows]
            lines.append(
                f"| {run.label} | {rows[0]['step']:,} | {min(means):.2f} .. {max(means):.2f} | "
                f"{max(r['std_deg'] for r in rows):.2f} | {rows[0]['null_std_deg']:.2f} |"
            )
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def summary_table(runs: list[Run]) -> str:
    lines = ["| run | parameters | final val loss | tokens/s (median) |", "|---|---:|---:|---:|"]
    by_norm = defaultdict(list)
    for run in runs:
        rates = [v for _, v in run.metrics.get("train/tokens_per_sec", [])[1:]]  # step 0 includes warm-up
        rate = statistics.median(rates) if rates else math.nan
        by_norm[(run.config["model"]["name"], run.norm)].append((run.final("val/loss"), rate))
        lines.append(f"| {run.label} | {parameter_count(run.config):,} | {run.final('val/loss'):.4f} | {rate:,.0f} |")
    if any(len(v) > 1 for v in by_norm.values()):
        lines += [
            "",
            "| model, norm | seeds | final val loss (mean ± std) | tokens/s (mean) |",
            "|---|---:|---:|---:|",
        ]
        for (model, norm), values in sorted(by_norm.items()):
            losses, rates = zip(*values)
            spread = statistics.stdev(losses) if len(losses) > 1 else 0.0
            lines.append(
                f"| {model} {norm} | {len(values)} | {statistics.mean(losses):.4f} ± {spread:.4f} "
                f"| {statistics.mean(rates):,.0f} |"
            )
    return "\n".join(lines) + "\n"


def report(paths: list[Path], out: Path) -> None:
    for path in paths:
        if not path.exists():
            raise AnalysisError(f"{path} does not exist: give run directories, or directories holding runs")
    runs = find_runs(paths)
    if not runs:
        raise AnalysisError(f"no run (metrics.csv + config.yaml) under {', '.join(map(str, paths))}")
    tables = summary_table(runs) + "\n" + angle_table(runs)  # before anything is written: a failure writes nothing
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise AnalysisError(f"cannot create {out} ({e.strerror}): give a writable out=") from None
    plot_losses(runs, out / "loss.png")
    figures = ["loss.png"]
    with_angles = [r for r in runs if r.angles]
    for model in sorted({r.config["model"]["name"] for r in with_angles}):
        figures.append(f"angles_by_layer_{model}.png")
        plot_angles_by_layer([r for r in with_angles if r.config["model"]["name"] == model], out / figures[-1])
    for run in with_angles:
        figures.append(f"angles_training_{run.dir.name}.png")
        plot_angles_training(run, out / figures[-1])
    images = "".join(f"![{f}]({f})\n\n" for f in figures)
    (out / "summary.md").write_text(f"# normlab report\n\n{tables}\n{images}")
    print(tables + f"\nwrote {len(figures)} figures and summary.md to {out}")


def main(cfg: DictConfig) -> None:
    """normlab-report (conf/report.yaml, normlab.cli.report): the report of `runs` (one path, or a list) into `out`."""
    runs = None if OmegaConf.is_missing(cfg, "runs") else cfg.runs
    paths = [Path(str(p)) for p in (runs if OmegaConf.is_list(runs) else [runs]) if p is not None and str(p).strip()]
    if not paths:
        raise AnalysisError("no runs given: runs=DIR or runs=[DIR,...] (run directories, or directories holding runs)")
    report(paths, Path(str(cfg.out)) if cfg.out else paths[0] / "report")
