"""Where a command may write: one rule for every command that writes an output (export, sample, ablate, angles,
eval, report, bench, prepare), checked before any work starts.

- A command writes only what it owns. It never deletes or replaces a file or folder that it did not write itself.
- An `out=` that is, lies inside, or contains a run directory or a prepared corpus is refused. The exceptions are
  the places a command owns inside a run directory: `hf/` (export), `eval/` (eval), `ablation.csv` (ablate),
  `report/` (report).
- A command recognises its own earlier output by a marker it writes. A file's marker is its first line (a CSV's
  header, the title of a table). A folder's marker is `.normlab-<command>.json`, which lists the files it wrote.
  Only such an output is replaced. Where the command has `overwrite`, only with overwrite=true.
- Writes are atomic. A file is written to a temporary file beside it and renamed. A folder (a prepared corpus, an
  export, a report) is written into a staging folder and swapped in, and what a killed write left is put right by
  the next write on that machine. A kill mid-write leaves the old output whole.
"""

import csv
import glob
import io
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from normlab.common.errors import NormlabError

CORPUS_MARKER = "meta.json"  # with a token file: a prepared corpus (normlab-prepare)
CORPUS_SPLITS = ("train.bin", "val.bin", "probe.bin")
HOST = socket.gethostname()
SCAN_LIMIT = 5000  # folders looked at when telling what a folder given as out= contains


class OutputError(NormlabError):
    """An output path that the command must not write."""


def what_is(path: Path) -> str | None:
    """'a run directory' or 'a prepared corpus' when the folder `path` is one (by files only normlab writes there),
    else None."""
    if not path.is_dir():
        return None
    if (path / "run_id").is_file() or (path / ".claim").is_file() or (
        (path / "config.yaml").is_file()
        and ((path / "overrides.yaml").is_file() or any((path / "checkpoints").glob("*.ckpt.json")))
    ):
        return "a run directory"
    if (path / CORPUS_MARKER).is_file() and any((path / split).is_file() for split in CORPUS_SPLITS):
        return "a prepared corpus"
    return None


def enclosing(path: Path) -> tuple[Path, str] | None:
    """The nearest folder above `path` that is a run directory or a prepared corpus, with what it is."""
    for parent in path.absolute().parents:
        if kind := what_is(parent):
            return parent, kind
    return None


def contained(folder: Path, depth: int = 3) -> list[tuple[Path, str]]:
    """The run directories and prepared corpora in `folder`, up to `depth` levels down. The scan is bounded: it is
    only there to name what a refused out= holds."""
    found, level, seen = [], [folder], 0
    for _ in range(depth):
        children = []
        for directory in level:
            try:
                entries = sorted(p for p in directory.iterdir() if p.is_dir() and not p.is_symlink())
            except OSError:
                continue
            for entry in entries:
                seen += 1
                if kind := what_is(entry):
                    found.append((entry, kind))
                else:
                    children.append(entry)
            if seen > SCAN_LIMIT:
                return found
        level = children
    return found


def check_place(out: Path, command: str, owned_in_run: tuple[str, ...] = ()) -> None:
    """Refuse an out= that is, lies inside or contains a run directory or a prepared corpus. A run directory's
    entries named in `owned_in_run` are the command's own (ablate's ablation.csv, export's hf/...)."""
    out = out.absolute()
    if kind := what_is(out):
        raise OutputError(f"out={out} is {kind}: {command} never writes over one; give a new path")
    if found := enclosing(out):
        parent, kind = found
        inside = out.relative_to(parent).parts[0]
        if not (kind == "a run directory" and inside in owned_in_run):
            own = f" (in a run it writes only {', '.join(owned_in_run)})" if owned_in_run else ""
            raise OutputError(f"out={out} lies inside {kind}, {parent}, which {command} must not write to{own}: "
                              "give a path outside it")
    if out.is_dir() and (found := contained(out)):
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        raise OutputError(f"out={out} contains {found[0][1]}, {found[0][0]}{more}: {command} never writes over "
                          "one; give a new path")


def check_writable(out: Path) -> None:
    """The nearest existing folder of `out` takes a new file."""
    existing = next(p for p in out.absolute().parents if p.exists())
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise OutputError(f"cannot write {out} ({existing}: {e.strerror}): give a writable out=") from None


def first_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return f.readline(1 << 16).decode("utf-8", errors="replace").rstrip("\r\n")
    except OSError:
        return ""


def check_file(out: Path, command: str, written_by_command: Callable[[str], bool], *,
               owned_in_run: tuple[str, ...] = (), overwrite: bool | None = None, example: str = "output") -> None:
    """Before any work: `out` may be written as the command's output file. `written_by_command(first line)`
    recognises an earlier output of the command. `overwrite`: None for a command that updates its own output as
    it goes (adds rows to it); False to refuse even the command's own output. `example`: a file name to suggest."""
    if out.is_dir():
        raise OutputError(f"out={out} is a directory: give a file name, e.g. out={out / example}")
    check_place(out, command, owned_in_run)
    if out.exists() or out.is_symlink():
        if not out.is_file() or not written_by_command(first_line(out)):
            raise OutputError(f"out={out} exists and was not written by {command}: {command} replaces only its own "
                              "output; give a new file")
        if overwrite is False:
            raise OutputError(f"out={out} exists (an earlier output of {command}): give overwrite=true to replace "
                              "it, or a new file")
    check_writable(out)


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the renames in it reach the disk
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes) -> None:
    """`path` holds either its old content or `data`, whatever happens: a temporary file beside it, fsync, rename.
    An OSError leaves no temporary file behind (a kill may: `.<name>.tmp`, which the next write replaces)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_directory(path.parent)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def write_file(path: Path, data: str | bytes) -> None:
    """An output file written whole or not at all (replace_file); a failure is one line (OutputError)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, data.encode() if isinstance(data, str) else data)
    except OSError as e:
        raise OutputError(f"cannot write {path} ({e.strerror}): give a writable out=") from None


def write_csv(path: Path, columns, rows: list[dict], **writer_options) -> None:
    """A CSV file (csv.DictWriter's header and rows) written whole or not at all (write_file)."""
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=columns, **writer_options)
    writer.writeheader()
    writer.writerows(rows)
    write_file(path, buffer.getvalue())


# -- folders: a marker that lists what the command wrote


def marker(out: Path, command: str) -> Path:
    return out / f".{command}.json"


def written_files(out: Path, command: str) -> set[str] | None:
    """The files the command's marker in `out` lists, or None when `out` holds no marker of the command."""
    try:
        record = json.loads(marker(out, command).read_text())
        return set(record["files"]) if record.get("command") == command else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def remove_leftovers(out: Path, writer: str) -> None:
    """Remove what the writes of `out` that were killed on this machine left: their staging folders, and the old
    output one had renamed aside the instant before (put back if `out` is missing). Those of another machine (a
    file system shared by nodes) are only reported: their write may be running. `writer` names it ("a prepare")."""
    leftover = re.compile(rf"\.{re.escape(out.name)}\.(staging|old)-(.+)-(\d+)")
    for path in out.parent.glob(f".{glob.escape(out.name)}.*"):
        if not (match := leftover.fullmatch(path.name)):
            continue
        kind, host, pid = match[1], match[2], int(match[3])
        if host != HOST:
            print(f"warning: {path} is left by {writer} on {host}: delete it unless that one is still running",
                  file=sys.stderr)
        elif pid == os.getpid() or not running(pid):  # our own pid: reused from a dead process
            if kind == "old" and not out.exists():
                path.rename(out)
            else:
                shutil.rmtree(path)


@contextmanager
def staging(out: Path, writer: str, replace: bool = True) -> Iterator[Path]:
    """A new folder beside `out` to write the output into. When the block succeeds, it replaces `out` (the old
    folder is renamed aside, the new one into place, then the old one deleted); when the block fails, it is removed
    and `out` is left as it was. replace=False: `out` must not exist; one that appeared meanwhile is never moved
    aside (the rename into place fails on a file or a folder with anything in it)."""
    remove_leftovers(out, writer)
    new, old = (out.parent / f".{out.name}.{kind}-{HOST}-{os.getpid()}" for kind in ("staging", "old"))
    new.mkdir(parents=True)
    try:
        yield new
        if out.exists() and replace:
            out.rename(old)
        new.rename(out)
    except BaseException:
        if old.exists() and not out.exists():
            old.rename(out)
        shutil.rmtree(new, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def check_folder(out: Path, command: str, *, owned_in_run: tuple[str, ...] = (),
                 overwrite: bool | None = None) -> None:
    """Before any work: `out` may be written as the command's output folder. It is new or empty, or an earlier output
    of the command (its marker) holding nothing the command did not write. `overwrite`: None for a command that
    rewrites its own output each time (the report); False to refuse even that."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"out={out} is a file: give a folder")
    remove_leftovers(out, command)
    check_place(out, command, owned_in_run)
    if out.is_dir() and any(out.iterdir()):
        files = written_files(out, command)
        if files is None:
            raise OutputError(f"out={out} is not empty and was not written by {command}: {command} replaces only "
                              "its own output; give a new or empty folder")
        foreign = sorted(str(p.relative_to(out)) for p in out.rglob("*")
                         if not p.is_dir() and str(p.relative_to(out)) not in files | {marker(out, command).name})
        if foreign:
            raise OutputError(f"out={out} holds {foreign[0]}, which {command} did not write: move it away, or give a "
                              "new folder")
        if overwrite is False:
            raise OutputError(f"out={out} exists (an earlier output of {command}): give overwrite=true to replace "
                              "it, or a new folder")
    check_writable(out)


@contextmanager
def staged_folder(out: Path, command: str) -> Iterator[Path]:
    """staging(out), with the command's marker listing every file written added before the new folder replaces
    `out`; a failure to write is one line (OutputError)."""
    try:
        with staging(out, command) as new:
            yield new
            files = sorted(str(p.relative_to(new)) for p in new.rglob("*") if not p.is_dir())
            write_file(marker(new, command), json.dumps({"command": command, "files": files}, indent=1) + "\n")
    except OSError as e:
        raise OutputError(f"cannot write {out} ({e.strerror or e}): give a writable out=") from None
