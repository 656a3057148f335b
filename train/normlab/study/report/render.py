"""One renderer for the report's tables: a table is its columns (title, unit, format, alignment: the single source of
how each number is shown) and its rows (frozen dataclasses of numbers), written from the same objects to markdown,
to CSV (full precision, a column per number) and to a wandb.Table, so that a number cannot differ between them."""

import csv
import math
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

WIDTH = 120  # of a caption's lines (a table's rows are kept within it by their columns)


@dataclass(frozen=True)
class Column:
    """A column of a table: `keys`, the row's fields it shows (one; two for an interval [low, high], which CSV and
    wandb keep as two columns); `title` and `unit`, its markdown header, short (symbols, the caption defines them);
    `format`, the format spec of its numbers ("+.4f"; "" for text; "," for a count); `right`: aligned right."""
    keys: tuple[str, ...]
    title: str
    format: str = ""
    unit: str = ""
    right: bool = True

    @property
    def header(self) -> str:
        return f"{self.title} ({self.unit})" if self.unit else self.title

    def number(self, value) -> str:
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return "—"
        if isinstance(value, bool) or not self.format or isinstance(value, str):
            return str(value)
        if isinstance(value, float) and self.format.endswith("f") and value == 0:
            return "0"  # exactly: a simultaneous interval's end at Holm's decision, a control's rounding
        if isinstance(value, float) and self.format.endswith("f") and abs(value) < 5e-4:
            return f"{value:{self.format[0] if self.format[0] in '+-' else ''}.1e}"  # a rounding floor, not 0.0000
        return f"{value:{self.format}}"

    def cell(self, row) -> str:
        values = [row[key] if isinstance(row, Mapping) else getattr(row, key) for key in self.keys]
        if len(values) == 2:
            return "—" if None in values else f"[{self.number(values[0])}, {self.number(values[1])}]"
        return self.number(values[0]).replace("|", r"\|")


@dataclass(frozen=True)
class Table:
    """A table of the report: `name`, its CSV's stem and wandb key; `caption`, the definitions below it. Its rows are
    frozen dataclasses of numbers (the verdict's), or mappings of a column's key to its cell (the tables below the
    verdict, whose numbers their own CSVs hold)."""
    name: str
    columns: tuple[Column, ...]
    rows: tuple
    caption: str = ""

    def csv_columns(self) -> list[str]:
        """Every field of its rows, the shown ones first (a CSV holds what the markdown rounds, and more)."""
        shown = [key for column in self.columns for key in column.keys]
        every = ([] if not self.rows else list(self.rows[0]) if isinstance(self.rows[0], Mapping)
                 else [f.name for f in fields(self.rows[0])])
        return shown + [key for key in every if key not in shown]


def text_columns(*titles: str, right: tuple[int, ...] = ()) -> tuple[Column, ...]:
    """Columns of cells given as text, keyed by their titles; those at the positions `right` aligned right."""
    return tuple(Column((title,), title, right=i in right) for i, title in enumerate(titles))


def markdown(table: Table) -> str:
    """The table in markdown, its caption below it."""
    lines = ["| " + " | ".join(c.header for c in table.columns) + " |",
             "|" + "|".join("---:" if c.right else "---" for c in table.columns) + "|"]
    lines += ["| " + " | ".join(c.cell(row) for c in table.columns) + " |" for row in table.rows]
    caption = textwrap.fill(table.caption, WIDTH, break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines) + "\n" + (f"\n{caption}\n" if table.caption else "")


def csv_value(value):
    return "" if value is None else value


def value(row, key):
    return row[key] if isinstance(row, Mapping) else getattr(row, key)


def write_csv(table: Table, folder: Path) -> str:
    """The table's rows at full precision into folder/<name>.csv; its file name."""
    columns = table.csv_columns()
    with open(folder / f"{table.name}.csv", "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([csv_value(value(row, key)) for key in columns] for row in table.rows)
    return f"{table.name}.csv"


def wandb_table(table: Table):
    """The table as a wandb.Table, a column per number (None where there is none)."""
    import wandb

    columns = table.csv_columns()
    return wandb.Table(columns=columns, data=[[value(row, key) for key in columns] for row in table.rows])
