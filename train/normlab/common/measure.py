"""A command's cost, measured from outside while it runs: its seconds, the memory of its process tree and the bytes it
leaves on disk (normlab-bench's prepare and angles sections)."""

import subprocess
import time
from pathlib import Path


def process_tree_memory(root: int) -> tuple[int, int]:
    """(anonymous memory of the processes under `root`, largest RSS of one of them), in kB, from /proc.
    Anonymous memory is summed as Pss_Anon, so pages that forked workers share are counted once."""
    anon, largest, todo = 0, 0, [root]
    while todo:
        pid = todo.pop()
        try:
            rollup = dict(
                line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
            )
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        anon += int(rollup.get("Pss_Anon", "0 kB").split()[0])
        largest = max(largest, int(rollup.get("Rss", "0 kB").split()[0]))
    return anon, largest


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under `folder` (those that a running command removes meanwhile left out)."""
    total = 0
    for path in folder.rglob("*"):
        try:
            total += path.stat().st_size if path.is_file() else 0
        except FileNotFoundError:
            pass
    return total


def run_measured(cmd: list[str], disk: Path | None = None) -> tuple[float, float, float, float]:
    """Run `cmd`, sampling its process tree every 20 ms: (seconds, peak anonymous MB, peak RSS MB, and the peak MB of
    the files under `disk`). Anonymous memory is what a process allocates; RSS also counts pages of files it maps."""
    started = time.perf_counter()
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak_anon = peak_rss = peak_disk = 0
    while process.poll() is None:
        anon, rss = process_tree_memory(process.pid)
        peak_anon, peak_rss = max(peak_anon, anon), max(peak_rss, rss)
        if disk is not None:
            peak_disk = max(peak_disk, folder_bytes(disk))
        time.sleep(0.02)
    if process.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{process.stderr.read()[-2000:]}")
    return time.perf_counter() - started, peak_anon / 1024, peak_rss / 1024, peak_disk / 1e6
