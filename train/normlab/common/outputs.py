"""Where a command may write, and how: one rule for every command that writes an output (export, sample, ablate,
angles, eval, report, bench, prepare, convert), checked before any work starts and again in the act of writing.

- A command writes only what it owns. It never deletes or replaces a file or folder that it did not write itself, nor
  one it wrote that has been changed since, nor one that appears at `out=` while it works.
- An `out=` that is, lies inside, or contains a run directory or a prepared corpus is refused. The exceptions are
  the places a command owns inside a run directory: `hf/` (export), `eval/` (eval), `ablation.csv` (ablate),
  `report/` (report).
- A command recognises its own earlier output by the record it keeps of the bytes it wrote (size, sha256 and the
  modification time, which spares the hash while the file is untouched). A folder's record is its marker
  `.normlab-<command>.json`, listing every file; a file's is `.<name>.normlab-<command>.json` beside it. A file
  written before records existed is recognised by its first line (a CSV's header, a table's title), a folder by
  files no newer than its marker. Only such an output is replaced; where the command has `overwrite`, only with
  overwrite=true.
- The check before the work is repeated in the act of writing. A new output goes into place with a rename or link
  that fails if anything has appeared there (renameat2's RENAME_NOREPLACE; a hard link for a file). An earlier
  output is first renamed aside, then checked again; anything in it that the command did not write puts it back as
  it was, and the command ends with one line. Readers see the path missing for that instant.
- Writes are atomic (common/atomic.py). A file is written to a temporary file beside it, a folder (a prepared
  corpus, an export, a report) into a staging folder, each moved into place once complete; what a killed write
  left is put right by the next write on that machine. A kill mid-write leaves the old output whole.
- Outputs are readable as the user's umask says (0644 with the usual 022), whatever a library wrote them with.
"""

import csv
import glob
import hashlib
import io
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from normlab.common.atomic import fsync_directory, readable_as_umask, rename_new, replace_file, write_synced
from normlab.common.errors import NormlabError
from normlab.common.run_identity import run_files

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
    found = run_files(path)
    # a run's files by the rule of run_identity.run_files, but a config.yaml or a table alone (a user's own folder
    # may hold one such file)
    if ((path / ".claim").is_file() or len(found) > 1 or set(found) & {"run_id", "checkpoints"}
            or (found == ["config.yaml"] and (path / "overrides.yaml").is_file())):
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


# -- records of what a command wrote


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def record(path: Path, digest: str | None = None) -> dict:
    """What a command keeps of a file it wrote: its size, modification time and sha256."""
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest or sha256(path)}


def unchanged(path: Path, kept: dict) -> bool:
    """Whether the regular file `path` holds the bytes of the record `kept` (an untouched file by its size and
    modification time, else by its sha256: a copy keeps its bytes, not its time)."""
    try:
        stat = path.lstat()
        if not path.is_file() or path.is_symlink() or stat.st_size != kept["size"]:
            return False
        return stat.st_mtime_ns == kept.get("mtime_ns") or sha256(path) == kept["sha256"]
    except (OSError, KeyError, TypeError):
        return False


def record_path(path: Path, command: str) -> Path:
    """Where the record of the output file `path` of `command` is kept: a hidden file beside it."""
    return path.with_name(f".{path.name}.{command}.json")


def kept_records(path: Path, command: str) -> list[dict] | None:
    """The records of `path` that `command` kept (any of them is the file as it left it), or None: none kept."""
    try:
        kept = json.loads(record_path(path, command).read_text())
        return list(kept["records"]) if kept.get("command") == command else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def not_own(path: Path, records: list[dict] | None, command: str, recognise: Callable[[str], bool]) -> str:
    """'' when the file at `path` is `command`'s output as it left it (one of `records`); else why not. Without
    records (a file written before they were kept): by its first line."""
    if not path.is_file() or path.is_symlink():
        return f"was not written by {command}"
    if records is None:
        return "" if recognise(first_line(path)) else f"was not written by {command}"
    return "" if any(unchanged(path, r) for r in records) else f"was changed since {command} wrote it"


def check_file(out: Path, command: str, recognise: Callable[[str], bool], *,
               owned_in_run: tuple[str, ...] = (), overwrite: bool | None = None, example: str = "output") -> None:
    """Before any work: `out` may be written as the command's output file. `recognise(first line)` tells an earlier
    output of the command written before records were kept. `overwrite`: None for a command that updates its own
    output as it goes (adds rows to it); False to refuse even the command's own output. `example`: a file name to
    suggest."""
    if out.is_dir():
        raise OutputError(f"out={out} is a directory: give a file name, e.g. out={out / example}")
    check_place(out, command, owned_in_run)
    remove_leftovers(out, command)
    if out.exists() or out.is_symlink():
        if why := not_own(out, kept_records(out, command), command, recognise):
            raise OutputError(f"out={out} exists and {why}: {command} replaces only its own output as it left it; "
                              "give a new file")
        if overwrite is False:
            raise OutputError(f"out={out} exists (an earlier output of {command}): give overwrite=true to replace "
                              "it, or a new file")
    check_writable(out)


# -- writing: atomic, and never over anything the command does not own


def write_file(path: Path, data: str | bytes) -> None:
    """A file of a staging folder written whole or not at all (replace_file); a failure is one line (OutputError)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, data.encode() if isinstance(data, str) else data)
    except OSError as e:
        raise OutputError(f"cannot write {path} ({e.strerror}): give a writable out=") from None


def aside_path(out: Path, kind: str) -> Path:
    return out.with_name(f".{out.name}.{kind}-{HOST}-{os.getpid()}")


def kept_aside(path: Path, out: Path) -> Path:
    """Rename what could not go back to `out` to a visible name beside it; its new path."""
    kept = out.with_name(f"{out.name}.kept-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    path.rename(kept)
    return kept


def put_back(aside: Path, out: Path) -> str:
    """Move `aside` back to `out`; where something took `out` meanwhile, to a visible name: what became of it."""
    try:
        rename_new(aside, out)
        return "left as it was"
    except FileExistsError:
        return f"moved to {kept_aside(aside, out)}, as something else took its place meanwhile"


def remove_own(folder: Path, foreign: Callable[[Path], list[str]], out: Path, writer: str) -> None:
    """Delete `folder`, an earlier output renamed aside, unless something in it is not the writer's (written into it
    after it was checked): then keep it, renamed to a visible name, with a warning."""
    if found := foreign(folder):
        kept = kept_aside(folder, out)
        print(f"warning: {found[0]} appeared in the earlier {out} while {writer} replaced it: kept in {kept}",
              file=sys.stderr, flush=True)
    else:
        shutil.rmtree(folder)


def write_output(out: Path, data: str | bytes, command: str, recognise: Callable[[str], bool]) -> None:
    """The command's output file `out`, whole or not at all, written only over the command's own output as it left
    it (not_own), the check made again in the act: a file that appeared at `out` meanwhile, or one the command
    wrote that was changed meanwhile, is left as it was (OutputError). Its record is kept beside it."""
    data = data.encode() if isinstance(data, str) else data
    tmp, aside, records = aside_path(out, "tmp"), aside_path(out, "old"), record_path(out, command)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_synced(tmp, data)
        readable_as_umask(tmp)
        new = record(tmp, hashlib.sha256(data).hexdigest())
        earlier = kept_records(out, command)
        moved = move(out, aside)
        if moved and not_own(aside, earlier, command, recognise):
            raise OutputError(f"out={out} was written by something else while {command} worked: "
                              f"{put_back(aside, out)}; give a new file")
        kept = [new, *(earlier or [])]  # either is ours, whenever this is cut short
        replace_file(records, (json.dumps({"command": command, "records": kept}) + "\n").encode())
        try:
            rename_new(tmp, out)
        except FileExistsError:
            raise OutputError(f"out={out} appeared while {command} worked: left as it was; give a new file") from None
        finally:
            if moved:
                aside.unlink()  # the earlier output, checked: ours
        replace_file(records, (json.dumps({"command": command, "records": [new]}) + "\n").encode())
        fsync_directory(out.parent)
    except OSError as e:
        raise OutputError(f"cannot write {out} ({e.strerror or e}): give a writable out=") from None
    finally:
        tmp.unlink(missing_ok=True)


def move(path: Path, aside: Path) -> bool:
    """Rename `path` aside (one act: what is checked next is what was there); False when nothing was there."""
    try:
        path.rename(aside)
        return True
    except FileNotFoundError:
        return False


def write_csv(out: Path, columns, rows: list[dict], command: str, recognise: Callable[[str], bool],
              **writer_options) -> None:
    """A CSV output (csv.DictWriter's header and rows) written as write_output writes."""
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=columns, **writer_options)
    writer.writeheader()
    writer.writerows(rows)
    write_output(out, buffer.getvalue(), command, recognise)


# -- folders: a marker that records what the command wrote


def marker(out: Path, command: str) -> Path:
    return out / f".{command}.json"


def not_written(folder: Path, command: str) -> list[str]:
    """What `folder` holds that `command` did not write, or changed since, by its marker: paths relative to it ([]
    for an empty folder; the marker's name where there is no marker of the command). A marker from before records
    were kept lists names: a file is then the command's if it is no newer than the marker."""
    try:
        entries = sorted(folder.rglob("*"))
    except FileNotFoundError:
        return []
    if not entries:
        return []
    path = marker(folder, command)
    try:
        written = json.loads(path.read_text())
        files, dirs = written["files"], set(written.get("dirs", []))
        if written.get("command") != command:
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [path.name]
    newest = path.stat().st_mtime_ns
    found = []
    for entry in entries:
        name = str(entry.relative_to(folder))
        if entry == path or (entry.is_dir() and not entry.is_symlink() and (name in dirs or isinstance(files, list))):
            continue
        if isinstance(files, list):  # names only
            own = name in files and entry.is_file() and not entry.is_symlink() and entry.stat().st_mtime_ns <= newest
        else:
            own = name in files and unchanged(entry, files[name])
        if not own:
            found.append(name)
    return found


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def remove_leftovers(out: Path, writer: str, foreign: Callable[[Path], list[str]] | None = None) -> None:
    """Put right what the writes of `out` killed on this machine left: their staging folders and temporary files are
    removed; an earlier output renamed aside is put back if `out` is missing, else removed where `foreign` finds
    nothing in it that the writer did not write (else kept, renamed to a visible name). Those of another machine (a
    file system shared by nodes) are only reported: their write may be running. `writer` names it ("a prepare")."""
    leftover = re.compile(rf"\.{re.escape(out.name)}\.(staging|old|tmp)-(.+)-(\d+)")
    for path in out.parent.glob(f".{glob.escape(out.name)}.*"):
        if not (match := leftover.fullmatch(path.name)):
            continue
        kind, host, pid = match[1], match[2], int(match[3])
        if host != HOST:
            print(f"warning: {path} is left by {writer} on {host}: delete it unless that one is still running",
                  file=sys.stderr)
        elif pid == os.getpid() or not running(pid):  # our own pid: reused from a dead process
            if kind == "old" and not (out.exists() or out.is_symlink()):
                path.rename(out)
            elif kind == "old" and (foreign is None or not path.is_dir()):
                print(f"warning: {path} is an earlier {out} that a write of {writer} cut short left: delete it "
                      "unless you need it", file=sys.stderr)
            elif kind == "old":
                remove_own(path, foreign, out, writer)
            elif path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


@contextmanager
def staging(out: Path, writer: str, foreign: Callable[[Path], list[str]] | None = None) -> Iterator[Path]:
    """A new folder beside `out` to write the output into. When the block succeeds it takes `out`'s place, the check
    and the swap one act: a folder at `out` is renamed aside, and checked again with `foreign` (what it holds that
    the writer did not write); with anything found, or with `foreign` None (a new-only output), it is put back as it
    was and OutputError says why. The earlier output is then deleted (remove_own), and the new folder renamed into
    place unless something appeared there meanwhile (rename_new). When the block fails, the staging folder is
    removed and `out` is left as it was."""
    remove_leftovers(out, writer, foreign)
    new, old = aside_path(out, "staging"), aside_path(out, "old")
    new.mkdir(parents=True)
    moved = False
    try:
        yield new
        readable_as_umask(new)
        moved = move(out, old)
        if moved and (found := [old.name] if foreign is None or old.is_symlink() else foreign(old)):
            moved = False
            what = "appeared"
            if foreign is not None:
                what = f"holds {found[0]}, which {writer} did not write (or has changed),"
            raise OutputError(f"out={out} {what} while {writer} worked: {put_back(old, out)}; give a new path, or "
                              "move it away")
        try:
            rename_new(new, out)
        except FileExistsError:
            earlier = f"; the earlier output {put_back(old, out)}" if moved else ""
            moved = False
            raise OutputError(f"out={out} appeared while {writer} worked: left as it was{earlier}; give a new "
                              "path") from None
        fsync_directory(out.parent)
    except BaseException:
        if moved and old.exists():
            put_back(old, out)
            moved = False
        shutil.rmtree(new, ignore_errors=True)
        raise
    finally:
        if moved and old.exists():
            remove_own(old, foreign, out, writer)


def check_folder(out: Path, command: str, *, owned_in_run: tuple[str, ...] = (),
                 overwrite: bool | None = None) -> None:
    """Before any work: `out` may be written as the command's output folder. It is new or empty, or an earlier output
    of the command (its marker) holding nothing the command did not write or has been changed since. `overwrite`:
    None for a command that rewrites its own output each time (the report); False to refuse even that."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"out={out} is a file: give a folder")
    remove_leftovers(out, command, lambda folder: not_written(folder, command))
    check_place(out, command, owned_in_run)
    if out.is_dir() and any(out.iterdir()):
        found = not_written(out, command)
        if found == [marker(out, command).name]:
            raise OutputError(f"out={out} is not empty and was not written by {command}: {command} replaces only "
                              "its own output; give a new or empty folder")
        if found:
            changed = (out / found[0]).is_file() and found[0] in written_names(out, command)
            why = f"has changed since {command} wrote it" if changed else f"{command} did not write"
            raise OutputError(f"out={out} holds {found[0]}, which {why}: move it away, or give a new folder")
        if overwrite is False:
            raise OutputError(f"out={out} exists (an earlier output of {command}): give overwrite=true to replace "
                              "it, or a new folder")
    check_writable(out)


def written_names(out: Path, command: str) -> set[str]:
    """The names of the files that the marker of `command` in `out` lists."""
    try:
        return set(json.loads(marker(out, command).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return set()


@contextmanager
def staged_folder(out: Path, command: str) -> Iterator[Path]:
    """staging(out), with the command's marker recording every file written (and folder made) added before the new
    folder replaces `out`, which must be new, empty or the command's own earlier output as it left it (not_written);
    a failure to write is one line (OutputError)."""
    try:
        with staging(out, command, lambda folder: not_written(folder, command)) as new:
            yield new
            entries = sorted(new.rglob("*"))
            files = {str(p.relative_to(new)): record(p) for p in entries if p.is_file() and not p.is_symlink()}
            dirs = [str(p.relative_to(new)) for p in entries if p.is_dir() and not p.is_symlink()]
            write_file(marker(new, command), json.dumps({"command": command, "files": files, "dirs": dirs},
                                                        indent=1) + "\n")
    except OSError as e:
        raise OutputError(f"cannot write {out} ({e.strerror or e}): give a writable out=") from None
