"""The angles table: the columns of angles.csv (what was measured, then one row per layer, site, reference and
position), the identity columns of a normlab run, and reading the CSV files normlab writes back, a damaged row named
by its line."""

import csv
from collections.abc import Callable
from pathlib import Path

from normlab.common.errors import NormlabError

REFERENCES = ("uniform", "random_a", "random_b")
POSITIONS = ("all", "first", "rest")
IDENTITY_COLUMNS = ("run", "model", "norm", "seed", "source")  # what was measured: any number of them share a CSV
CSV_COLUMNS = (*IDENTITY_COLUMNS, "step", "layer", "site", "reference", "position", "count", "mean_deg", "std_deg",
               "sem_deg", "min_deg", "max_deg", "mean_norm", "mean_cos2", "null_mean_deg", "null_std_deg",
               "null_percentile", "null_random_mean_deg", "null_random_std_deg", "null_directions", "d", "histogram",
               "null_random_means_deg", "null_random_cos2")
PER_DIRECTION_COLUMNS = ("null_random_means_deg", "null_random_cos2")  # J numbers a row, added to the end in turn


def is_angles_header(line: str) -> bool:
    """The first line of an angles CSV that normlab writes now, or wrote before null_random_cos2 or before
    null_random_means_deg too (an earlier file that normlab-angles adds to: rewritten with the columns, empty in its
    old rows)."""
    return line in [",".join(CSV_COLUMNS[:len(CSV_COLUMNS) - k]) for k in range(len(PER_DIRECTION_COLUMNS) + 1)]


class AnalysisError(NormlabError):
    """Input that normlab-angles or normlab-report cannot analyse as given."""


class DamagedTable(AnalysisError):
    """A CSV file with a row cut short or damaged."""


def run_identity(config: dict, source: str) -> dict:
    """The IDENTITY_COLUMNS of a normlab model, from its run's config."""
    return {"run": config["run_name"], "model": config["model"]["name"], "norm": config["norm"]["name"],
            "seed": config["seed"], "source": source}


def read_rows(path: str | Path, parse: Callable[[str, str], object], columns=("step",)) -> list[dict]:
    """The rows of a CSV file that normlab writes, each value through parse(column, value). A header without
    `columns`, a row cut short (the last line without its newline), with another number of fields than the header,
    or with a value that does not parse raises DamagedTable naming its line (training.rundir.tables.read_table drops the
    same rows, silently)."""
    lines = Path(path).read_bytes().decode("utf-8", errors="replace").split("\n")
    if lines.pop():
        raise DamagedTable(f"{path}, line {len(lines) + 1}, is cut short (no newline at its end)")
    header = next(csv.reader(lines[:1]), [])
    if lines and (missing := [c for c in columns if c not in header]):
        raise DamagedTable(f"{path}, line 1: the header has no {', '.join(missing)} column")
    rows = []
    for number, line in enumerate(lines[1:], start=2):
        fields = next(csv.reader([line]), [])
        if len(fields) != len(header):
            raise DamagedTable(f"{path}, line {number}, has {len(fields)} fields, its header {len(header)}")
        row = {}
        for column, value in zip(header, fields):
            try:
                row[column] = parse(column, value)
            except ValueError:
                raise DamagedTable(f"{path}, line {number}: {column} '{value[:20]}' is not a number") from None
        rows.append(row)
    return rows


ANGLE_COLUMN_TYPES = {
    **dict.fromkeys(IDENTITY_COLUMNS, str),  # seed too: empty for a Hugging Face model
    "step": int,
    "layer": int,
    "count": int,
    "d": int,
    "site": str,
    "reference": str,
    "position": str,
    "histogram": lambda v: [int(c) for c in v.split()],
    **dict.fromkeys(PER_DIRECTION_COLUMNS, lambda v: [float(c) for c in v.split()]),
}  # any other column: float
OPTIONAL_COLUMNS = ("sem_deg", "null_percentile", "null_random_mean_deg", "null_random_std_deg", "null_directions",
                    *PER_DIRECTION_COLUMNS)
REQUIRED_COLUMNS = tuple(c for c in CSV_COLUMNS if c not in IDENTITY_COLUMNS + OPTIONAL_COLUMNS)  # older files too


def parse_angle_value(column: str, value: str):
    if value == "" and column in OPTIONAL_COLUMNS:
        return None  # no random-direction null (rotation rows, or null_directions=0)
    return ANGLE_COLUMN_TYPES.get(column, float)(value)


def read_csv(path: str | Path) -> list[dict]:
    """angles.csv as dicts of numbers (histogram: a list of counts per degree). Files written before the identity
    and null columns existed read as well, without them."""
    return read_rows(path, parse_angle_value, REQUIRED_COLUMNS)
