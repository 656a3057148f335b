"""A callback of the tests' own, given to normlab-train as a user's would be (`+callbacks.pace._target_=pacing.Pace`
with tests/ on PYTHONPATH): it sleeps after every training step. A job that must only stay alive until Slurm's timer
signals it (a minute or more) then trains at a real job's pace, a few steps a second, instead of keeping a core busy
that the other test workers need."""

import time

from lightning.pytorch.callbacks import Callback


class Pace(Callback):
    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(self.seconds)
