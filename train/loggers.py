"""A CSV logger that continues the run's metrics.csv (Lightning's deletes it when a run resumes)."""

import csv

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
