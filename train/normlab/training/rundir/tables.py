"""metrics.csv and angles.csv of a run directory: CSV tables whose rows one writer appends (torn rows told apart
from whole ones), rewritten atomically, and made consistent with the checkpoint a run resumes from (the rows of an
interrupted attempt after it dropped, the validation rows lost before it validated again from a checkpoint of their
step where one holds it, the others reported)."""

import csv
import io
from collections.abc import Callable
from pathlib import Path

from normlab.common.atomic import fsync_file
from normlab.training.rundir.files import warn, write_atomically

METRICS_FILE = "metrics.csv"
ANGLES_FILE = "angles.csv"


def read_table(path: Path) -> tuple[list[str], list[dict], int]:
    """(header, whole rows, rows dropped) of a CSV file. A row is dropped when it is torn (the file's last line
    without its newline: a write cut short), has another number of fields than the header, or has no integer step."""
    if not path.is_file():
        return [], [], 0
    text = path.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    torn = lines.pop() != ""  # after the last newline: empty, unless the last row was cut short
    if not lines:
        return [], [], int(torn)
    header = next(csv.reader([lines[0]]))
    rows, dropped = [], int(torn)
    for fields in csv.reader(lines[1:]):
        row = dict(zip(header, fields))
        if len(fields) != len(header) or not row.get("step", "").isdigit():
            dropped += 1
            continue
        rows.append(row)
    return header, rows, dropped


def write_table(path: Path, header: list[str], rows: list[dict]) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=header, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomically(path, buffer.getvalue().encode())


def step_ranges(steps: list[int]) -> str:
    """'3, 7-9' for [3, 7, 8, 9]."""
    parts, start = [], None
    for i, step in enumerate(steps):
        start = step if start is None else start
        if i + 1 == len(steps) or steps[i + 1] != step + 1:
            parts.append(f"{start}" if start == step else f"{start}-{step}")
            start = None
    return ", ".join(parts)


class RunTables:
    """The tables of the run directory `run`: reconciled with the checkpoint a run resumes from, on disk before
    every checkpoint (RunDirectory), angles.csv written a step at a time (the angles callback)."""

    def __init__(self, run: Path):
        self.metrics, self.angles = run / METRICS_FILE, run / ANGLES_FILE

    def keep_metrics_before(self, step: int, validates_after: Callable[[int], bool],
                            checkpoint_of: Callable[[int], Path | None], since: int = 0) -> dict[int, Path]:
        """metrics.csv holds exactly the rows of the steps before `step`, the resume step: torn rows and the rows an
        interrupted attempt logged after its checkpoint are dropped. Of the validation rows missing before it (after
        the optimizer steps s for which validates_after(s)), those of a step whose weights a checkpoint holds
        (checkpoint_of(s): an intact one, else None) are returned, s -> checkpoint, to be validated again
        (revalidate.py); the others, and the training rows missing, are reported. `since`: the step the run started
        at (a branch's), the rows before which it never had."""
        path = self.metrics
        header, rows, torn = read_table(path)
        if not header:
            return {}
        kept = [r for r in rows if int(r["step"]) < step]
        if torn:
            warn(f"{path}: dropped {torn} torn or damaged row{'s' * (torn > 1)}")
        if len(kept) != len(rows) or torn:
            write_table(path, header, kept)
        if "train/loss" not in header:
            return {}
        # the validation after optimizer step s (1-based) is logged with the step of that optimizer step's row, s - 1
        validated = {int(r["step"]) + 1 for r in kept if r.get("val/loss")}
        lost = [s for s in range(since or 1, step + 1) if validates_after(s) and s not in validated]
        found = {s: checkpoint for s in lost if (checkpoint := checkpoint_of(s)) is not None}
        gaps = []
        trained = {int(r["step"]) for r in kept if r.get("train/loss")}
        for kind, missing in (("training", sorted(set(range(step)) - trained)),
                              ("validation", [s - 1 for s in lost if s not in found])):
            missing = [s for s in missing if s >= since]
            if missing:
                gaps.append(f"{kind} rows for step{'s' * (len(missing) > 1)} {step_ranges(missing)}")
        if gaps:
            warn(f"{path} has no {' and no '.join(gaps)} (lost with the file; they cannot be regenerated)")
        return found

    def put_metrics(self, new: list[dict]) -> None:
        """Put rows into metrics.csv after the rows of their step and those before it (where training logged a
        validation: the last row of its step), columns it lacks added as the logger adds them; atomic."""
        header, rows, _ = read_table(self.metrics)
        added = {k for row in new for k in row} - set(header)
        if added:
            header = ["step", *sorted(set(header) - {"step"} | added)]
        for row in sorted(new, key=lambda r: r["step"]):
            rows.insert(next((i for i, r in enumerate(rows) if int(r["step"]) > row["step"]), len(rows)), row)
        write_table(self.metrics, header, rows)

    def keep_angles_until(self, step: int) -> None:
        path = self.angles
        header, rows, torn = read_table(path)
        kept = [r for r in rows if int(r["step"]) <= step]
        if torn:
            warn(f"{path}: dropped {torn} torn or damaged row{'s' * (torn > 1)} (their step is measured again)")
        if header and (torn or len(kept) != len(rows)):
            write_table(path, header, kept)

    def angle_rows_per_step(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for row in read_table(self.angles)[1]:
            counts[int(row["step"])] = counts.get(int(row["step"]), 0) + 1
        return counts

    def write_angles(self, records: list[dict], columns: list[str]) -> None:
        """Put the rows of one step into angles.csv (replacing any of that step), in step order; atomic."""
        step = records[0]["step"]
        _, rows, _ = read_table(self.angles)
        rows = [r for r in rows if int(r["step"]) != step] + records
        write_table(self.angles, columns, sorted(rows, key=lambda r: int(r["step"])))

    def sync(self) -> None:
        """metrics.csv to disk (angles.csv is always written atomically)."""
        fsync_file(self.metrics)
