"""Errors that mean "the user asked for something that cannot run": reported in one line, exit code 2; and the
stop signals, which end a run with its progress saved."""

import os
import signal
import sys


class NormlabError(Exception):
    exit_code = 2


class ConfigError(NormlabError, ValueError):
    """A configuration that cannot describe a valid run."""


class DataError(NormlabError):
    """Prepared data that is missing, incomplete or does not fit the run."""


class TokenizerError(NormlabError):
    """No usable GPT-2 tokenizer."""


class NonFiniteError(NormlabError):
    """Training produced a non-finite loss or gradient."""


class Interrupted(NormlabError):
    """A stop signal ended the run with its progress saved: exit code 128 + the signal's number, as a shell reports
    a process the signal ended."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


# Signals that stop a run after its optimizer step, with its progress saved (callbacks.Preemption): SIGTERM (scancel,
# Slurm preemption, kill, a container stopping), SIGUSR1 (Slurm's warning before the time limit, under sbatch) and
# SIGINT (Ctrl-C; Lightning would catch its KeyboardInterrupt and exit 1, saving nothing); in a job of Hydra's
# submitit launcher also SIGUSR2, submitit's warning before the time limit and on preemption.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
SUBMITIT_SIGNAL = signal.SIGUSR2
received: list[int] = []  # the stop signals this process has received
submitit_handler = []  # submitit's own SIGUSR2 handler, in a submitit job: it requeues the job, once the run is saved


def under_submitit() -> bool:
    return os.environ.get("SUBMITIT_EXECUTOR") == "slurm"


def note_signal(signum, frame) -> None:
    if signum == signal.SIGINT:
        # A second Ctrl-C ends the process at once, by SIGINT's default action, also mid-save (a Python handler would
        # wait for the C call in progress, a checkpoint's write say): the next start resumes from the newest intact
        # checkpoint, as after SIGKILL. So the line that says so is written at the first one. (The handler also
        # comes back here when Lightning's teardown has put it back.)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if signal.SIGINT in received:
            os.kill(os.getpid(), signal.SIGINT)
        # os.write: print() may be in use by the code this handler interrupted (a reentrant call raises)
        os.write(2, f"{os.path.basename(sys.argv[0])}: Ctrl-C: stopping after this step, its progress saved; a second "
                    "Ctrl-C stops at once, without saving (the next start resumes from the newest intact "
                    "checkpoint)\n".encode())
    received.append(signum)


def install_signal_handlers() -> None:
    """At the start of the process (the CLI), and again when training starts: Trainer.fit installs Lightning's own
    SIGTERM handler, which ends a run with exit code 0 and saves nothing. In a submitit job, submitit's SIGUSR2
    handler (which requeues the job and exits at once, mid-step) is kept for after the save (normlab.cli). Installed
    also where SIGINT was ignored (a command started with & from a script), so that Ctrl-C saves there too; not
    again after a first Ctrl-C, so that a second one ends the process."""
    for signum in STOP_SIGNALS:
        if not (signum == signal.SIGINT and signum in received):
            signal.signal(signum, note_signal)
    if under_submitit():
        if (handler := signal.getsignal(SUBMITIT_SIGNAL)) is not note_signal and callable(handler):
            submitit_handler[:] = [handler]
        signal.signal(SUBMITIT_SIGNAL, note_signal)


def requeue_with_submitit(stop: Interrupted, message: str) -> None:
    """A submitit job stopped by SIGUSR2 with its run saved: say so, and let submitit's handler requeue the job (it
    exits). Called by the CLI, not read from there: submitit pickles the CLI's Hydra task by value, with copies of
    the module globals it names."""
    if stop.exit_code == 128 + SUBMITIT_SIGNAL and submitit_handler:
        print(message, file=sys.stderr, flush=True)
        submitit_handler[0](SUBMITIT_SIGNAL, None)


def process_rank() -> int:
    """This process's global rank before any process group exists: srun, torchrun and Lightning's launcher set
    these variables (0 when none is set: a single process, or the one that launches the others)."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    return (
        rank
        or int(os.environ.get("LOCAL_RANK", 0))
        or int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0)))
    )
