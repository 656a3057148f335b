"""Atomic writes, the one module that makes them (the run directory's files through training/run_files.py, every
command's outputs through common/outputs.py): a file replaced whole or not at all, a rename that never replaces
what is at its target, and the permissions the user's umask gives."""

import ctypes
import errno
import os
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the renames in it reach the disk
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes) -> None:
    """`path` holds either its old content or `data`, whatever happens: a temporary file beside it, fsync, rename.
    An OSError leaves no temporary file behind (a kill may: `.<name>.tmp`, which the next write replaces). For the
    files a writer owns whatever they hold: a run directory's, those of a staging folder."""
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
