"""Atomic writes, the one module that makes them (the run directory's files and checkpoints through
training/rundir/files.py, which words their errors, every command's outputs through common/outputs.py): a file replaced
whole or not at all, a second name given to a file in one act, a rename that never replaces what is at its target,
and the permissions the user's umask gives."""

import ctypes
import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the renames in it reach the disk
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """What was written to `path` (a file that a writer appends to) reaches the disk; nothing if there is no file."""
    if path.is_file():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """`path` holding `data`, on disk when this returns; not atomic itself: for a temporary file renamed into place."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def temporary(path: Path) -> Path:
    """Where a write of `path` puts the new content first: `.<name>.tmp` beside it."""
    return path.with_name(f".{path.name}.tmp")


def partial_writes(folder: Path) -> list[Path]:
    """The temporary files in `folder` of writes that a kill cut short (an error leaves none)."""
    return sorted(folder.glob(".*.tmp"))


@contextmanager
def replacing(path: Path) -> Iterator[BinaryIO]:
    """A file to write `path`'s new content into, streamed: when the block ends, `path` holds either its old content
    or all that was written, whatever happens (a temporary file beside it, fsync, rename). For the files a writer
    owns whatever they hold: a run directory's, those of a staging folder."""
    tmp = temporary(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_directory(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def replace_file(path: Path, data: bytes) -> None:
    """`path` holds either its old content or `data`, whatever happens (replacing)."""
    with replacing(path) as f:
        f.write(data)


def link_over(source: Path, target: Path) -> None:
    """`target` becomes a second name of the file `source` in one act (a hard link beside it renamed over it): at
    every moment both exist. On a file system without hard links, `source` is renamed to `target`."""
    tmp = temporary(target)
    try:
        tmp.unlink(missing_ok=True)
        os.link(source, tmp)
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)
        os.replace(source, target)
    fsync_directory(target.parent)


AT_FDCWD, RENAME_NOREPLACE = -100, 1  # <fcntl.h>, <stdio.h>
libc = ctypes.CDLL(None, use_errno=True)
renameat2 = getattr(libc, "renameat2", None)  # glibc 2.28 and later


def rename_new(source: Path, target: Path) -> None:
    """Rename `source` to `target` if nothing is at `target`, in one act: FileExistsError if something is. Where the
    kernel or file system lacks RENAME_NOREPLACE: a hard link for a file; for a folder rename(2), which fails on a
    file or a folder holding anything (an empty folder that appeared in that instant is replaced)."""
    if renameat2 is not None:
        if renameat2(AT_FDCWD, os.fsencode(source), AT_FDCWD, os.fsencode(target), RENAME_NOREPLACE) == 0:
            return
        error = ctypes.get_errno()
        if error == errno.EEXIST:
            raise FileExistsError(error, os.strerror(error), str(target))
        if error not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # else: no RENAME_NOREPLACE here
            raise OSError(error, os.strerror(error), str(source))
    exists = FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
    if source.is_dir() and not source.is_symlink():
        if target.exists() or target.is_symlink():
            raise exists
        try:
            source.rename(target)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENOTEMPTY):  # something appeared there
                raise exists from None
            raise
    else:
        os.link(source, target)  # FileExistsError if anything is there
        source.unlink()


def readable_as_umask(path: Path) -> None:
    """Give `path` (and what a folder holds) the permissions a new file or folder gets under this process's umask:
    libraries write some files 0600 (safetensors, mkstemp), unreadable by a lab's group on a shared cluster."""
    mask = os.umask(0)
    os.umask(mask)
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not item.is_symlink():
            item.chmod((0o777 if item.is_dir() else 0o666) & ~mask)
