"""normlab-bench: measurements printed as one table, side by side in one run, and written to a file.

    normlab-bench prepare        data preparation: tokens/s and peak memory at 1x and 4x corpus size
    normlab-bench angles         angle probe pass vs plain forward (time ratio), and its memory at 1x and 10x tokens
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


def run_measured(cmd: list[str]) -> tuple[float, float, float]:
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
            seconds, anon, rss = run_measured(cmd)
            tokens = json.loads((out / "meta.json").read_text())["splits"]["train"]["tokens"]
            mb = corpus.stat().st_size / 1e6
            rows.append((f"prepare {mb:.0f} MB of text ({tokens / 1e6:.1f}M tokens)",
                         f"{tokens / seconds:,.0f} tokens/s; peak memory {anon:,.0f} MB (all processes, "
                         f"anonymous), largest process RSS {rss:,.0f} MB"))
    return rows


def probe_setup(model_name: str, seq_len: int):
    import torch

    from train.angles import measure, norm_sites
    from train.cli import build_model
    from train.paths import CONF_DIR

    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", [f"model={model_name}", f"model.block_size={seq_len}"])
    model = build_model(cfg)
    model.init_weights(0)
    model.eval()
    sites, d = norm_sites(model, "normlab"), model.config.n_embd
    return torch, model, lambda batches: measure(lambda ids, mask: model.hidden(ids), sites, d, batches)


def bench_angles(model_name: str, seq_len: int, batch: int, repeats: int) -> list[tuple[str, str]]:
    """Interleaved repetitions of the plain forward and the probe pass on the same batches; medians."""
    import statistics

    torch, model, probe = probe_setup(model_name, seq_len)
    batches = [(torch.randint(0, 50257, (batch, seq_len), generator=torch.Generator().manual_seed(i)), None) for i in range(2)]
    plain, hooked = [], []
    with torch.no_grad():
        probe(batches[:1])  # warm-up
        for _ in range(repeats):
            started = time.perf_counter()
            for ids, _ in batches:
                model.hidden(ids)
            plain.append(time.perf_counter() - started)
            started = time.perf_counter()
            probe(batches)
            hooked.append(time.perf_counter() - started)
    ratio = statistics.median(hooked) / statistics.median(plain)
    rows = [(f"angle probe pass / plain forward ({model_name}, {2 * batch}x{seq_len} tokens, median of {repeats})",
             f"{ratio:.3f} (target <= 1.15)")]
    mem = []
    for windows in (32, 320):
        cmd = [sys.executable, "-m", "train.bench", "--probe-memory", str(windows), "--model", model_name, "--seq-len", str(seq_len)]
        mem.append(run_measured(cmd)[1])
    rows.append((f"angle probe peak memory, {32 * seq_len:,} vs {320 * seq_len:,} tokens ({model_name})",
                 f"{mem[0]:,.0f} MB vs {mem[1]:,.0f} MB (ratio {mem[1] / mem[0]:.3f}, target: unchanged)"))
    return rows


def probe_memory(model_name: str, seq_len: int, windows: int) -> None:
    """The probe pass over `windows` random windows, in batches of 8 (run in a subprocess by bench_angles)."""
    torch, _, probe = probe_setup(model_name, seq_len)
    gen = torch.Generator().manual_seed(0)
    probe((torch.randint(0, 50257, (8, seq_len), generator=gen), None) for _ in range(windows // 8))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="normlab-bench", description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="*", choices=["prepare", "angles", []], help="default: all")
    parser.add_argument("--scale", type=int, default=2, help="copies of the embedded corpus in the 1x prepare corpus")
    parser.add_argument("--model", default="70m", help="model preset for the angle benchmark")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--probe-memory", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "checkpoints" / "bench" / "bench.md")
    args = parser.parse_args(argv)
    if args.probe_memory:
        return probe_memory(args.model, args.seq_len, args.probe_memory)
    rows, sections = [], args.sections or ["prepare", "angles"]
    if "prepare" in sections:
        rows += bench_prepare(args.scale)
    if "angles" in sections:
        rows += bench_angles(args.model, args.seq_len, 4, args.repeats)
    table = "| measurement | result |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    print(table + f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
