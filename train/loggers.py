"""A CSV logger that continues the run's metrics.csv (Lightning's deletes it when a run resumes), and the callback
that keeps it free of duplicates when a run resumes from a checkpoint older than its last logged step."""

import csv
import os

import lightning as L

from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class AppendingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):  # keep the rows, and the header they were written with
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                self.metrics_keys = list(csv.DictReader(f).fieldnames or [])


class CSVLogger(LightningCSVLogger):
    """Writes <save_dir>/metrics.csv (and hparams.yaml), appending to what an earlier attempt wrote."""

    def __init__(self, save_dir: str, **kwargs):
        super().__init__(save_dir, name="", version="", **kwargs)

    @property
    @rank_zero_experiment
    def experiment(self) -> AppendingWriter:
        if self._experiment is None:
            self._fs.makedirs(self.log_dir, exist_ok=True)
            self._experiment = AppendingWriter(log_dir=self.log_dir)
        return self._experiment


class ResumeMetrics(L.Callback):
    """When a run starts or resumes, drops from metrics.csv the rows of the steps it is about to log: what an
    attempt killed after its last checkpoint had logged (checkpoints are written once every row of their step is
    on disk, so the rows before the checkpoint's step are complete)."""

    def on_train_start(self, trainer, pl_module):
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger) and os.path.isfile(path := logger.experiment.metrics_file_path):
                with open(path, newline="") as f:
                    reader = csv.DictReader(f)
                    kept = [row for row in reader if int(row["step"]) < trainer.global_step]
                with open(f"{path}.tmp", "w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=reader.fieldnames)
                    writer.writeheader()
                    writer.writerows(kept)
                os.replace(f"{path}.tmp", path)
