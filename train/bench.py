"""normlab-bench: measurements printed as one table, side by side in one run, and written to a file.

    normlab-bench prepare        data preparation: tokens/s and peak memory at 1x and 4x corpus size
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from train.paths import PROJECT_ROOT

def process_tree_memory(root: int) -> tuple[int, int]:
    """(anonymous memory of the processes under `root`, largest RSS of one of them), in kB, from /proc.
    Anonymous memory is summed as Pss_Anon, so pages that forked workers share are counted once."""
    anon, largest, todo = 0, 0, [root]
    while todo:
        pid = todo.pop()
        try:
            rollup = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        anon += int(rollup.get("Pss_Anon", "0 kB").split()[0])
        largest = max(largest, int(rollup.get("Rss", "0 kB").split()[0]))
    return anon, largest


def measure(cmd: list[str]) -> tuple[float, float, float]:
    """Run `cmd`, sampling its process tree every 20 ms: (seconds, peak anonymous MB, peak RSS MB).
    Anonymous memory is what a process allocates; RSS also counts pages of files it maps and reads."""
    started = time.perf_counter()
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak_anon = peak_rss = 0
    while process.poll() is None:
        anon, rss = process_tree_memory(process.pid)
        peak_anon, peak_rss = max(peak_anon, anon), max(peak_rss, rss)
        time.sleep(0.02)
    if process.returncode:
        raise SystemExit(f"normlab-bench: {' '.join(cmd)} failed:\n{process.stderr.read()[-2000:]}")
    return time.perf_counter() - started, peak_anon / 1024, peak_rss / 1024


def bench_prepare(scale: int) -> list[tuple[str, str]]:
    """Prepare local jsonl corpora of 1x and 4x the size, made of the embedded corpus cut into documents."""
    from omegaconf import OmegaConf

    from train.prepare import load_documents

    source = OmegaConf.load(PROJECT_ROOT / "conf/data/embedded.yaml").source
    texts = load_documents("embedded", source)["text"]
    docs = [t[i : i + 4000] for t in texts for i in range(0, len(t), 4000)]  # ~4 KB, like a web page
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for factor in (scale, 4 * scale):
            corpus = Path(tmp) / f"corpus{factor}.jsonl"
            with open(corpus, "w") as f:
                for copy in range(factor):
                    f.writelines(json.dumps({"text": f"[{copy}] {d}"}) + "\n" for d in docs)
            out = Path(tmp) / f"prepared{factor}"
            cmd = [str(Path(sys.executable).parent / "normlab-prepare"), "data=files", f"data.dir={out}",
                   f"data.source.files=[{corpus}]", "data.source.val_fraction=0.001"]
            seconds, anon, rss = measure(cmd)
            tokens = json.loads((out / "meta.json").read_text())["splits"]["train"]["tokens"]
            mb = corpus.stat().st_size / 1e6
            rows.append((f"prepare {mb:.0f} MB of text ({tokens / 1e6:.1f}M tokens)",
                         f"{tokens / seconds:,.0f} tokens/s; peak memory {anon:,.0f} MB (all processes, "
                         f"anonymous), largest process RSS {rss:,.0f} MB"))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="normlab-bench", description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="*", default=["prepare"], choices=["prepare"])
    parser.add_argument("--scale", type=int, default=2, help="copies of the embedded corpus in the 1x prepare corpus")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "checkpoints" / "bench" / "bench.md")
    args = parser.parse_args(argv)
    rows = []
    if "prepare" in args.sections:
        rows += bench_prepare(args.scale)
    table = "| measurement | result |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    print(table + f"\nwrote {args.out}")
