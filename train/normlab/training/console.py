"""What a training run prints: the libraries' messages reduced to what a user needs to read. Lightning's logger gets
no console of its own beside Hydra's (each message once), and messages that say nothing about the run are dropped."""

import logging
import re
import warnings

NOISE = (  # the libraries' messages that say nothing about this run
    "💡 Tip:",  # advertisements for litlogger and litmodels
    "TPU available",
    "HPU available",
    "`srun` command is available",  # Lightning, under a Slurm allocation where the run was not started by srun
    "isinstance(treespec, LeafSpec)",  # a deprecation inside Lightning itself
)


class DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in NOISE)


DROP_NOISE = DropNoise()


def quiet_libraries() -> None:
    """Call once Lightning is imported (it adds its own console handler when imported)."""
    root, lightning_logger = logging.getLogger(), logging.getLogger("lightning")
    if root.handlers:  # under Hydra: its console prints Lightning's messages, Lightning's own would print them twice
        for handler in list(lightning_logger.handlers):
            lightning_logger.removeHandler(handler)
    for handler in [*root.handlers, *lightning_logger.handlers]:
        handler.addFilter(DROP_NOISE)  # one instance: each job of a sweep calls this again, adding nothing
    for text in NOISE:
        warnings.filterwarnings("ignore", message=f".*{re.escape(text)}")
