"""What the parts of a run directory share: the error saying that a run directory cannot be used as asked, the
warning line, and the run directory's writes: common/atomic.py's, their failure worded as a RunDirError that names
the file and what to do."""

import errno
import shutil
import sys
from pathlib import Path

from normlab.common.atomic import partial_writes, replace_file
from normlab.common.errors import NormlabError


class RunDirError(NormlabError):
    """The run directory cannot be used as asked (in use, damaged beyond resuming, disk full...)."""


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def write_atomically(path: Path, data: bytes) -> None:
    """`path` holds either its old content or `data`, whatever happens (common/atomic.py)."""
    try:
        replace_file(path, data)
    except OSError as e:
        raise write_error(path, e) from None


def remove_partial_writes(folder: Path) -> None:
    """Remove the temporary files (`.<name>.tmp`) that writes cut short left in `folder`, each with a warning."""
    for partial in partial_writes(folder):
        warn(f"removing {partial}, left by a save that was cut short")
        partial.unlink(missing_ok=True)


def write_error(path: Path, e: OSError) -> RunDirError:
    if e.errno == errno.ENOSPC:
        free = shutil.disk_usage(path.parent).free
        return RunDirError(f"no space left on device while writing {path} ({free / 2**20:,.0f} MB free there): free "
                           "space on that file system, or give another run_dir; the earlier files are intact")
    return RunDirError(f"cannot write {path} ({e.strerror}): check the permissions and the file system of run_dir")
