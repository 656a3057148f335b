"""normlab-report RUN_OR_SWEEP_DIR...: loss curves (LN vs RMS, train and val) and a summary table.

Writes <out>/loss.png and <out>/summary.md (out defaults to <first dir>/report) and prints the table.
"""

import argparse
import csv
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

NORM_COLORS = {"layernorm": "tab:blue", "rmsnorm": "tab:red"}


@dataclass
class Run:
    dir: Path
    config: dict
    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    @property
    def norm(self) -> str:
        return self.config["norm"]["name"]

    @property
    def label(self) -> str:
        return f"{self.config['model']['name']} {self.norm} seed {self.config['seed']}"

    def final(self, key: str) -> float:
        return self.metrics[key][-1][1] if self.metrics.get(key) else math.nan


def load_run(run_dir: Path) -> Run:
    run = Run(run_dir, OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml")))
    with open(run_dir / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("step", "epoch") and value:
                    run.metrics.setdefault(key, []).append((int(row["step"]), float(value)))
    return run


def find_runs(paths: list[Path]) -> list[Run]:
    dirs = sorted({m.parent for p in paths for m in ([p / "metrics.csv"] + sorted(p.glob("**/metrics.csv"))) if m.is_file()})
    return [load_run(d) for d in dirs if (d / "config.yaml").is_file()]


def parameter_count(config: dict) -> int:
    from train.cli import build_model  # imported late: the CLI imports Lightning

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
    ax_train.set(title="training loss (moving average of 10 steps)", xlabel="optimizer step", ylabel="cross-entropy (nats/token)")
    ax_val.set(title="validation loss", xlabel="optimizer step")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_table(runs: list[Run]) -> str:
    lines = ["| run | parameters | final val loss | tokens/s (median) |", "|---|---:|---:|---:|"]
    by_norm = defaultdict(list)
    for run in runs:
        rates = [v for _, v in run.metrics.get("train/tokens_per_sec", [])[1:]]  # step 0 includes warm-up
        rate = statistics.median(rates) if rates else math.nan
        by_norm[(run.config["model"]["name"], run.norm)].append((run.final("val/loss"), rate))
        lines.append(f"| {run.label} | {parameter_count(run.config):,} | {run.final('val/loss'):.4f} | {rate:,.0f} |")
    if any(len(v) > 1 for v in by_norm.values()):
        lines += ["", "| model, norm | seeds | final val loss (mean ± std) | tokens/s (mean) |", "|---|---:|---:|---:|"]
        for (model, norm), values in sorted(by_norm.items()):
            losses, rates = zip(*values)
            spread = statistics.stdev(losses) if len(losses) > 1 else 0.0
            lines.append(f"| {model} {norm} | {len(values)} | {statistics.mean(losses):.4f} ± {spread:.4f} | {statistics.mean(rates):,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="normlab-report", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="run directories, or directories holding runs")
    parser.add_argument("--out", type=Path, help="output directory (default: <first path>/report)")
    args = parser.parse_args(argv)
    runs = find_runs(args.paths)
    if not runs:
        parser.exit(2, f"normlab-report: error: no run (metrics.csv + config.yaml) under {', '.join(map(str, args.paths))}\n")
    out = args.out or args.paths[0] / "report"
    out.mkdir(parents=True, exist_ok=True)
    plot_losses(runs, out / "loss.png")
    table = summary_table(runs)
    (out / "summary.md").write_text(f"# normlab report\n\n![losses](loss.png)\n\n{table}")
    print(table + f"\nwrote {out / 'loss.png'} and {out / 'summary.md'}")
