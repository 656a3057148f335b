"""Progress of long work that a job's log can show: tqdm's bar on a terminal; where the output is not a terminal (a
Slurm job's log), a whole line at most every `log_every` seconds and at the end, instead of the carriage returns
that a log file shows as one ever-growing line."""

import sys

from tqdm.auto import tqdm

LOG_FORMAT = "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%) [elapsed {elapsed}, ETA {remaining}, {rate_fmt}{postfix}]"
LOG_FORMAT_NO_TOTAL = "{desc}: {n_fmt} [elapsed {elapsed}, {rate_fmt}{postfix}]"


def is_terminal(stream=None) -> bool:
    stream = stream or sys.stderr
    return hasattr(stream, "isatty") and stream.isatty()


class Progress(tqdm):
    """A tqdm bar that writes lines in a log (see the module). The same arguments as tqdm; `log_every` seconds
    between the lines of a log (default 60)."""

    def __init__(self, *args, log_every: float = 60.0, **kwargs):
        self.in_log = not is_terminal(kwargs.get("file"))
        self.log_every, self.printed_at, self.last_line = log_every, None, None
        if self.in_log:
            kwargs["mininterval"] = max(kwargs.get("mininterval", 0.1), log_every)
            kwargs["miniters"] = None  # timed by mininterval alone (tqdm's default adapts it to the first updates)
            # a line of text: no bar drawn in characters (a library's own format draws one)
            kwargs["bar_format"] = LOG_FORMAT if kwargs.get("total") or (args[1:2] and args[1]) else LOG_FORMAT_NO_TOTAL
            kwargs["dynamic_ncols"] = False
        super().__init__(*args, **kwargs)

    def display(self, msg=None, pos=None):
        if not self.in_log:
            return super().display(msg, pos)
        return self.print_line(msg)

    def print_line(self, msg=None, force: bool = False) -> bool:
        """The bar as a line of the log: the first, then one every log_every seconds (tqdm also refreshes a bar
        after each tqdm.write, which is no time for a line), and the last (force)."""
        line = self.__str__() if msg is None else msg
        now = self._time()
        due = force or self.printed_at is None or now - self.printed_at >= self.log_every
        if not line.strip() or not due or line == self.last_line:  # an empty message clears a bar: none in a log
            return False
        self.fp.write(line + "\n")
        self.fp.flush()
        self.printed_at, self.last_line = now, line
        return True

    def clear(self, nolock=False):
        if not self.in_log:  # in a log there is no bar to take away before another line is written
            super().clear(nolock)

    def close(self):
        if self.in_log and not self.disable and self.leave is not False:
            self.leave = False  # the last line, then tqdm's closing, which would add an empty line
            self.print_line(force=True)
        super().close()
