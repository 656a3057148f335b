"""metrics.csv: a Lightning logger that appends one row per logging call and continues the file when a run resumes
(Lightning's CSVLogger deletes it, and rewrites it in place, unprotected, whenever a new column appears)."""

import csv
from argparse import Namespace
from pathlib import Path

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only

from normlab.training.rundir.tables import METRICS_FILE, read_table, write_table


class CSVLogger(Logger):
    """Writes <save_dir>/metrics.csv: a `step` column, then the metrics in alphabetical order. Rows are appended
    (and flushed) whenever Lightning saves the logger, which is after every logging call; a new column rewrites
    the file atomically. The run directory drops the rows of an interrupted attempt before a run resumes, and
    flushes the file to disk before every checkpoint (train/normlab/training/rundir/directory.py, tables.py)."""

    def __init__(self, save_dir: str):
        super().__init__()
        self.path = Path(save_dir) / METRICS_FILE
        self.pending: list[dict] = []
        self.columns: list[str] | None = None

    @property
    def name(self) -> str:
        return "csv"

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self.path.parent)

    @rank_zero_only
    def log_hyperparams(self, params: dict | Namespace) -> None:
        pass  # config.yaml holds them

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.pending.append({"step": step, **{k: float(v) for k, v in metrics.items()}})

    @rank_zero_only
    def save(self) -> None:
        if not self.pending:
            return
        if self.columns is None:
            self.columns = read_table(self.path)[0] or ["step"]
        new = sorted({k for row in self.pending for k in row} - set(self.columns))
        if new:
            self.columns = ["step", *sorted(set(self.columns) - {"step"} | set(new))]
            _, rows, _ = read_table(self.path)
            write_table(self.path, self.columns, rows + self.pending)
        else:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.columns, lineterminator="\n").writerows(self.pending)
        self.pending = []

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()
