"""normlab-bench sections=[...] (conf/bench.yaml): measurements printed as one table, side by side in one run, and
written to a file. The sections:

    framework      normlab-train's step vs a minimal plain PyTorch loop, same model and batches (CPU)
    norms          LayerNorm, RMSNorm and DyT forward+backward, the project's and torch's, fp32 and bf16
    step           a whole training step, RMS and DyT vs LN (on a GPU: the 410m model, and its MFU)
    gains          the step with each speed setting switched off in turn: its gain (cluster/gains.py)
    precision      the same training in float32, bf16 and fp16 autocast: the 16-bit losses against float32's
    prepare        data preparation: tokens/s and peak memory at 1x and 4x corpus size; OpenWebText's archives:
                   their reading rate, and a prepare of them (tokens/s, memory, disk)
    angles         angle probe pass vs plain forward (time ratio), and its memory at 1x and 10x tokens
    profile        a torch.profiler trace of the step section's step, and where its time goes (cluster/profile.py)
    preflight      on a GPU node: each paper preset trains a few steps on one GPU, PASS or FAIL against
                   the resource plan (memory, MFU); only when named (normlab/cluster/preflight.py)

Times are medians of repetitions interleaved between the things compared, so that a machine shared with other
work slows them alike; ratios are what to read.
"""

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from normlab.common.measure import run_measured
from normlab.common.paths import CONF_DIR

SECTIONS = ["framework", "norms", "step", "gains", "precision", "prepare", "angles", "profile"]
CHECKS = ["preflight"]  # pass/fail checks: run only when named


def interleaved(fns: dict, repeats: int, device) -> dict[str, float]:
    """Median seconds of each function over `repeats` rounds, each round calling every function once, in an order
    shuffled from round to round (a function that runs right after a costly one runs slower: no one neighbour)."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {name: [] for name in fns}
    for fn in fns.values():  # warm-up (and the first-use build of the fused kernel, or compilation)
        fn()
    order, shuffle = list(fns), random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(order)
        for name in order:
            fn = fns[name]
            sync()
            started = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def norm_layers(names: list[str]) -> dict:
    """Each norm of `names` (conf/norm/<name>.yaml, a user's own through hydra.searchpath) as the factory training
    builds its layers with: its `norm.layer`, instantiated."""
    from hydra.utils import instantiate

    return {name: instantiate(compose([f"norm={name}"]).norm.layer) for name in names}


def norm_ratios(t: dict, names: list[str], at_most: dict) -> str:
    """'rmsnorm / layernorm 0.98 (target <= 1); dyt / layernorm 1.66': each norm's time over the reference's (the
    first), with its target where `at_most` gives one."""
    reference = names[0]
    return "; ".join(f"{name} / {reference} {t[name] / t[reference]:.2f}"
                     + (f" (target <= {at_most[name]:g})" if name in at_most else "") for name in names[1:])


def bench_norms(device, rows: int, repeats: int, names: list[str], at_most: dict) -> list[tuple[str, str]]:
    """The norms of `names` (the first the reference) and torch's layer_norm and rms_norm functions, forward+backward
    at the paper widths."""
    import torch
    import torch.nn.functional as F

    factories, results = norm_layers(names), []
    for dtype in (torch.float32, torch.bfloat16):
        for d in (512, 768, 1024, 2048):
            x = torch.randn(rows, d, device=device, dtype=dtype, requires_grad=True)
            grad = torch.randn_like(x)
            layers = {name: factory(d).to(device, dtype) for name, factory in factories.items()}
            weight = torch.ones(d, device=device, dtype=dtype, requires_grad=True)
            t = interleaved(
                {
                    **{name: lambda m=m: m(x).backward(grad) for name, m in layers.items()},
                    "torch_ln": lambda: F.layer_norm(x, (d,), weight, weight, 1e-5).backward(grad),
                    "torch_rms": lambda: F.rms_norm(x, (d,), weight, 1e-5).backward(grad),
                },
                repeats,
                device,
            )
            against_torch = ", ".join(f"{name} {t[name] / t['torch_ln']:.2f}" for name in names)
            results.append(
                (
                    f"norm forward+backward, {str(dtype)[6:]}, d={d} ({rows} rows, {device.type})",
                    f"{norm_ratios(t, names, at_most)}; against torch's layer_norm: {against_torch}; torch's "
                    f"rms_norm / layer_norm {t['torch_rms'] / t['torch_ln']:.2f}",
                )
            )
    return results


SEARCHPATH: list[str] = []  # the config folders that normlab-bench's own command line added (a user's norms)


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    searchpath = [f"hydra.searchpath=[{','.join(SEARCHPATH)}]"] if SEARCHPATH else []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("train", [*searchpath, *overrides])


def step_shape(device, seq_len: int, gpu_model: str = "410m") -> tuple[list[str], int]:
    """The model and micro-batch of the step, gains, precision and profile sections: on a GPU the paper's
    `gpu_model` (step_model), compiled whole, 8 sequences; on CPU 2 layers of the 70m width at a context of `seq_len`,
    4 sequences."""
    if device.type == "cuda":
        return [f"model={gpu_model}", "runtime.compile=model"], 8
    return ["model=70m", "model.n_layer=2", f"model.block_size={seq_len}"], 4


def training_step(cfg, device, batch: int):
    """The module of `cfg` on `device`, and its plain optimizer step on one fixed batch of `batch` sequences."""
    import torch

    from normlab.training.module import plain_step
    from normlab.training.pipeline import build_module

    module = build_module(cfg).to(device)
    optimizer = module.configure_optimizers()["optimizer"]
    ids = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.block_size + 1), device=device,
                        generator=torch.Generator(device).manual_seed(0))
    return module, lambda: plain_step(module, optimizer, (ids[:, :-1], ids[:, 1:]), 1.0, device.type)


def bench_step(device, repeats: int, names: list[str], at_most: dict, seq_len: int = 256,
               gpu_model: str = "410m") -> list[tuple[str, str]]:
    """One optimizer step (forward, backward, clipping, fused AdamW) of the same model with each norm of `names` (the
    first the reference), on the same batch: on a GPU the paper's 410m model in bf16, compiled whole, and its
    MFU; on CPU a 2-layer model of the 70m width at a context of `seq_len`."""
    import torch

    from normlab.training.runtime import peak_flops

    shape, batch = step_shape(device, seq_len, gpu_model)
    steps, modules = {}, {}
    for norm in names:
        modules[norm], steps[norm] = training_step(compose([*shape, f"norm={norm}"]), device, batch)
    t = interleaved(steps, repeats, device)
    reference = names[0]
    tokens = batch * modules[reference].model.config.block_size
    name = f"{shape[0][6:]}{'' if device.type == 'cuda' else ' (2 layers)'}, {batch}x{tokens // batch} tokens"
    rows = [
        (
            f"training step {norm} / {reference} ({name}, {device.type})",
            f"{t[norm] / t[reference]:.3f}{f' (target <= {at_most[norm]:g})' if norm in at_most else ''}; "
            f"{reference} {tokens / t[reference]:,.0f} tokens/s, {norm} {tokens / t[norm]:,.0f} tokens/s",
        )
        for norm in names[1:]
    ]
    if peak := peak_flops(device):
        for norm in steps:
            mfu = tokens / t[norm] * modules[norm].model.flops_per_token() / peak
            rows.append(
                (
                    f"MFU, {name}, {norm}, bf16, compiled, fused AdamW ({torch.cuda.get_device_name(device)})",
                    f"{100 * mfu:.1f}% (target >= 45%)",
                )
            )
    return rows


def bench_framework(steps: int) -> list[tuple[str, str]]:
    """normlab-train's trainer (the real config: Lightning, every callback, loggers, progress bar) against a minimal
    plain PyTorch step training a second copy of the model on the same batches, in lockstep: after each framework
    step a callback runs one plain step, so that a machine shared with other work slows both alike. The framework's
    time per step is what passes between the end of one plain step and the end of the next framework step; both
    models start from the same weights, so the weights they end with show that the framework computed the same thing."""
    import lightning as L
    import torch

    from normlab.training.module import plain_step
    from normlab.training.pipeline import build, build_module, train

    class PlainTwin(L.Callback):
        def __init__(self, cfg):
            self.module, datamodule = build_module(cfg), build(cfg.data)
            datamodule.setup("fit")
            self.batches = iter(datamodule.train_dataloader())
            optimizers = self.module.configure_optimizers()
            self.optimizer, self.schedule = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
            self.clip = cfg.trainer.gradient_clip_val
            self.framework, self.plain, self.same_batches, self.plain_end = [], [], True, None

        def on_train_batch_end(self, trainer, pl_module, outputs, framework_batch, batch_idx):
            started = time.perf_counter()
            if self.plain_end is not None:
                self.framework.append(started - self.plain_end)
            batch = next(self.batches)
            plain_step(self.module, self.optimizer, batch, self.clip)
            self.schedule.step()
            self.plain_end = time.perf_counter()
            self.plain.append(self.plain_end - started)
            self.same_batches &= all(torch.equal(a, b) for a, b in zip(batch, framework_batch))

    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose([f"run_dir={tmp}/run", "trainer.accelerator=cpu", "logger=csv", f"trainer.max_steps={steps}",
                       f"trainer.val_check_interval={steps}", f"checkpoints.every={steps}", "probe.tokens=8192",
                       "data.val_tokens=4096", "probe.null_directions=16"])  # validation, checkpoints after the last
        twin = PlainTwin(cfg)
        module = train(cfg, extra_callbacks=[twin])
    same = twin.same_batches and all(torch.equal(a, b) for a, b in zip(module.parameters(), twin.module.parameters()))
    # each framework step against the plain step just before it: neighbours in time share the machine's state
    ratio = statistics.median(plain / framework for plain, framework in zip(twin.plain, twin.framework))
    tokens = cfg.data.batch_size * cfg.model.block_size
    return [(f"normlab-train / plain PyTorch loop, tokens/s ({cfg.model.name} model, {tokens} tokens per step, "
             f"median over {len(twin.framework)} pairs of neighbouring steps, cpu)",
             f"{ratio:.3f} (target >= 0.98); {'identical' if same else 'DIFFERENT'} batches and weights "
             f"after {steps} steps")]


def bench_prepare(scale: int) -> list[tuple[str, str]]:
    """Prepare local jsonl corpora of 1x and 4x the size, made of the embedded corpus cut into documents."""
    from omegaconf import OmegaConf

    from normlab.data.prepare import load_documents

    source = OmegaConf.load(CONF_DIR / "data" / "embedded.yaml").source
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
            seconds, anon, rss, _ = run_measured(cmd)
            tokens = json.loads((out / "meta.json").read_text())["splits"]["train"]["tokens"]
            mb = corpus.stat().st_size / 1e6
            rows.append((f"prepare {mb:.0f} MB of text ({tokens / 1e6:.1f}M tokens)",
                         f"{tokens / seconds:,.0f} tokens/s; peak memory {anon:,.0f} MB (all processes, "
                         f"anonymous), largest process RSS {rss:,.0f} MB"))
        rows += bench_archives(docs, scale, Path(tmp) / "owt")
    return rows


def bench_archives(docs: list[str], scale: int, tmp: Path) -> list[tuple[str, str]]:
    """OpenWebText's layout (data/archives.py) at its shape, 390 documents to an xz member, made of the same
    documents: each step in one process (read, tokenize, write in a split's order), then a prepare of a local copy."""
    import numpy as np

    from normlab.data import archives, tokenizer

    members = [[f"[{copy}] {d}" for d in docs[i : i + 390]] for copy in range(scale) for i in range(0, len(docs), 390)]
    (tmp / "copy" / "subsets").mkdir(parents=True)
    paths = [tmp / "copy" / "subsets" / f"urlsf_subset{a:02d}.tar" for a in range(2)]
    for a, path in enumerate(paths):
        archives.write_archive(path, members[a::2])
    units = [m for path in paths for m in archives.members(path)]
    started = time.perf_counter()
    text = sum(len(doc.encode()) for unit in units for doc in archives.documents(unit)) / 1e6
    read = time.perf_counter() - started
    archives.start_reader(tokenizer.gpt2())
    tokenized = [archives.tokenize(unit) for unit in units]  # read again, then tokenized
    tokenize = time.perf_counter() - started - 2 * read
    (tmp / "documents.bin").write_bytes(b"".join(tokens.tobytes() for tokens, _ in tokenized))
    lengths = np.concatenate([sizes for _, sizes in tokenized])
    started = time.perf_counter()
    archives.write_split(tmp / "documents.bin", lengths, np.random.default_rng(0).permutation(len(lengths)),
                         tmp / "split.bin")
    split = time.perf_counter() - started
    for done in ("documents.bin", "split.bin"):
        (tmp / done).unlink()
    packed = sum(p.stat().st_size for p in paths) / 1e6
    out = tmp / "openwebtext"
    cmd = [str(Path(sys.executable).parent / "normlab-prepare"), "data=openwebtext", f"data.dir={out}",
           f"data.source.path={tmp / 'copy'}", "~data.source.expected"]
    seconds, anon, rss, disk = run_measured(cmd, tmp)
    meta = json.loads((out / "meta.json").read_text())["splits"]
    tokens = sum(split["tokens"] for split in meta.values())
    return [
        (f"read OpenWebText-shaped archives ({len(units)} xz members: {packed:.0f} MB, {text:.0f} MB of text)",
         f"{packed / read:.1f} MB/s of archive ({text / read:.1f} MB/s of text) in one process"),
        (f"tokenize their {len(lengths):,} documents", f"{lengths.sum() / tokenize:,.0f} tokens/s in one process"),
        ("write their tokens in a split's order (a random permutation)",
         f"{2 * lengths.sum() / 1e6 / split:,.0f} MB/s in one process"),
        (f"prepare them (data=openwebtext from a local copy, {tokens / 1e6:.1f}M tokens)",
         f"{tokens / seconds:,.0f} tokens/s; peak memory {anon:,.0f} MB (all processes, anonymous), largest process "
         f"RSS {rss:,.0f} MB; peak disk {disk - packed:,.0f} MB beside the archives ({tokens * 2 / 1e6:,.0f} MB of "
         "tokens)"),
    ]


def probe_setup(model_name: str, seq_len: int, null_directions: int):
    import torch

    from normlab.probe.hooks import measure
    from normlab.probe.sites import norm_sites
    from normlab.training.pipeline import build_model

    model = build_model(compose([f"model={model_name}", f"model.block_size={seq_len}"]))
    model.init_weights(0)
    model.eval()
    sites, d = norm_sites(model, "normlab"), model.config.n_embd
    return torch, model, lambda batches: measure(lambda ids, mask: model.hidden(ids), sites, d, batches,
                                                 null_directions=null_directions)


def bench_angles(model_name: str, seq_len: int, batch: int, repeats: int,
                 null_directions: int) -> list[tuple[str, str]]:
    """Interleaved repetitions of the plain forward and the probe pass, without and with the null's random
    directions (as the paper's probe has them), on the same batches; medians."""
    torch, model, probe = probe_setup(model_name, seq_len, 0)
    _, _, probe_with_null = probe_setup(model_name, seq_len, null_directions)
    batches = [
        (torch.randint(0, 50257, (batch, seq_len), generator=torch.Generator().manual_seed(i)), None) for i in range(2)
    ]
    with torch.no_grad():
        t = interleaved(
            {"plain": lambda: [model.hidden(ids) for ids, _ in batches], "probe": lambda: probe(batches),
             "null": lambda: probe_with_null(batches)},
            repeats,
            torch.device("cpu"),
        )
    tokens = f"{model_name}, {2 * batch}x{seq_len} tokens, median of {repeats}"
    rows = [
        (f"angle probe pass / plain forward ({tokens})", f"{t['probe'] / t['plain']:.3f} (target <= 1.15)"),
        (f"angle probe pass with {null_directions} null directions / plain forward ({tokens})",
         f"{t['null'] / t['plain']:.3f} (what the percentile null costs on this CPU; matrix products and acos)"),
    ]
    mem = []
    for windows in (32, 320):
        cmd = [sys.executable, "-m", "normlab.bench", "--probe-memory", str(windows), "--model", model_name,
               "--seq-len", str(seq_len), "--null-directions", str(null_directions)]
        mem.append(run_measured(cmd)[1])
    rows.append((f"angle probe peak memory, {32 * seq_len:,} vs {320 * seq_len:,} tokens ({model_name})",
                 f"{mem[0]:,.0f} MB vs {mem[1]:,.0f} MB (ratio {mem[1] / mem[0]:.3f}, target: unchanged)"))
    return rows


def probe_memory(model_name: str, seq_len: int, windows: int, null_directions: int) -> None:
    """The probe pass over `windows` random windows, in batches of 8 (run in a subprocess by bench_angles)."""
    torch, _, probe = probe_setup(model_name, seq_len, null_directions)
    gen = torch.Generator().manual_seed(0)
    probe((torch.randint(0, 50257, (8, seq_len), generator=gen), None) for _ in range(windows // 8))


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    names = (
        [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        if cpuinfo.exists()
        else []
    )
    return f"{names[0]}, {len(os.sched_getaffinity(0))} cores" if names else platform.machine()


def written_by_bench(first_line: str) -> bool:
    """A table written before normlab kept records of its outputs: by its first line."""
    return first_line.startswith("normlab-bench ")


def main() -> None:
    """normlab-bench (conf/bench.yaml): the sections of `sections`, as one table printed and written to `out`; exit 1
    when a check fails. `--probe-memory N --model M --seq-len L --null-directions K` is the subprocess that
    bench_angles measures."""
    if sys.argv[1:2] == ["--probe-memory"]:
        parser = argparse.ArgumentParser(prog="normlab-bench --probe-memory")
        for flag, kind in (("--probe-memory", int), ("--model", str), ("--seq-len", int), ("--null-directions", int)):
            parser.add_argument(flag, type=kind, required=True)
        args = parser.parse_args()
        return probe_memory(args.model, args.seq_len, args.probe_memory, args.null_directions)
    from normlab.cli import hydra_app

    @hydra_app("bench")
    def bench(cfg) -> None:
        from normlab.common import outputs
        from normlab.common.errors import ConfigError
        from normlab.training.checks import positive_int

        sections = [cfg.sections] if isinstance(cfg.sections, str) else list(cfg.sections)
        unknown = [name for name in sections if name not in SECTIONS + CHECKS]
        if unknown or not sections:
            raise ConfigError(f"{f'unknown section {unknown[0]!r}' if unknown else 'no section'} in sections: choose "
                              f"from {', '.join(SECTIONS + CHECKS)}, e.g. sections=[norms,step]")
        for key in ("scale", "seq_len", "repeats", "rows", "steps", "precision_steps", "profile_steps"):
            positive_int(key, cfg[key])
        if cfg.preflight_batch not in ("preset", "auto"):
            raise ConfigError(f"preflight_batch={cfg.preflight_batch}: give preset (each preset's micro-batch and one "
                              "GPU's share of its step) or auto (its whole step on one GPU in micro-batches that fit)")
        out = Path(str(cfg.out))  # a new file, or an earlier table of normlab-bench (its first line)
        outputs.check_file(out, "normlab-bench", written_by_bench, example="bench.md")
        trace = out.with_name(f"{out.stem}-profile.json")  # the profile's Chrome trace, beside the table
        if "profile" in sections:
            from normlab.cluster.profile import written_by_profile

            outputs.check_file(trace, "normlab-bench", written_by_profile)
        import torch
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.hydra_config import HydraConfig
        from hydra.errors import HydraException

        from normlab.training.runtime import keep_freed_memory

        SEARCHPATH[:] = HydraConfig.get().searchpath  # a user's config folders (their norms), for compose
        GlobalHydra.instance().clear()  # the sections compose training configs of their own
        norms = [cfg.norms] if isinstance(cfg.norms, str) else [str(name) for name in cfg.norms]
        at_most = dict(cfg.at_most or {})
        if not norms or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in at_most.values()):
            raise ConfigError(f"norms={list(norms)}, at_most={at_most}: name the norms to compare, the reference first "
                              "(e.g. norms=[layernorm,rmsnorm]), and give at_most numbers")
        try:
            norm_layers(norms)
        except HydraException as e:
            raise ConfigError(f"norms={norms}: {str(e).splitlines()[0]} (conf/norm/, or a folder of yours given by "
                              "hydra.searchpath: docs/norms.md)") from None
        try:
            compose([f"model={cfg.step_model}"])
        except HydraException as e:
            raise ConfigError(f"step_model={cfg.step_model}: {str(e).splitlines()[0]} (conf/model/)") from None
        keep_freed_memory()  # as normlab-train does
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        rows = []
        if "framework" in sections:  # first, in a fresh process, as normlab-train runs
            rows += bench_framework(cfg.steps)
        if "norms" in sections:
            rows += bench_norms(device, cfg.rows, 10 * cfg.repeats, norms, at_most)
        if "step" in sections:
            rows += bench_step(device, 4 * cfg.repeats, norms, at_most, cfg.seq_len, cfg.step_model)
        if "gains" in sections or "precision" in sections:
            from normlab.cluster.gains import bench_gains, bench_precision

            shape, batch = step_shape(device, cfg.seq_len, cfg.step_model)
            if "gains" in sections:
                rows += bench_gains(device, 4 * cfg.repeats, shape, batch, norms[0],
                                    compose, training_step, interleaved)
            if "precision" in sections:  # on a CPU the tiny model: 16-bit matmuls are emulated there, and slow
                shape = shape if device.type == "cuda" else ["model=tiny", f"model.block_size={cfg.seq_len}"]
                rows += bench_precision(device, cfg.precision_steps, shape, batch, norms[0], compose)
        if "prepare" in sections:
            rows += bench_prepare(cfg.scale)
        if "angles" in sections:
            rows += bench_angles(cfg.model.name, cfg.seq_len, 4, 3 * cfg.repeats, cfg.null_directions)
        if "profile" in sections:
            from normlab.cluster.profile import profile_steps

            shape, batch = step_shape(device, cfg.seq_len, cfg.step_model)
            module, step = training_step(compose([*shape, f"norm={norms[0]}"]), device, batch)
            what = f"{module.model.config.n_layer}-layer d={module.model.config.n_embd} {norms[0]}, {batch} sequences"
            rows += profile_steps(step, cfg.profile_steps, device, trace, what)
        if "preflight" in sections:
            from normlab.cluster.preflight import preflight

            rows += preflight(device, cfg.preflight_batch)
        machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
        header = (
            f"normlab-bench {' '.join(sections)}: torch {torch.__version__}, {machine}, "
            f"{torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}\n\n"
        )
        table = header + "| measurement | result |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
        outputs.write_output(out, table, "normlab-bench", written_by_bench)
        print(table + f"\nwrote {out}")
        if any(result.startswith("FAIL") for _, result in rows):
            sys.exit(1)  # a failed check

    bench()


if __name__ == "__main__":
    main()
