"""The GPU-side paths, run on the CPU: sharded training (strategy=fsdp, FSDP2 over gloo), bf16-mixed and 16-mixed
autocast, and two nodes of one process each (two torchrun launches, as on two machines). Each against its unsharded,
float32 or one-process counterpart, and (but 16-mixed, whose loss scale is resumed in-process) interrupted by SIGTERM
and resumed: the resumed run must end as the uninterrupted one, step for step."""

import csv
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch.utils.data import DataLoader

from conftest import Command, compose_config, run_cli, start_cli
from normlab.cluster.preflight import random_windows
from normlab.model.norms import LayerNorm
from normlab.probe.hooks import AngleProbe
from normlab.probe.sites import NormSite
from normlab.probe.table import read_csv
from normlab.training.callbacks.stops import NonFiniteGuard
from normlab.training.pipeline import build_module, build_trainer

STEPS = 8
RUN = [
    "model.n_layer=2",
    "data.batch_size=2",
    "data.val_tokens=1024",
    "probe.tokens=4096",
    f"trainer.max_steps={STEPS}",
    "trainer.val_check_interval=2",  # validations (and last.ckpt) denser than the scheduled checkpoints
    "checkpoints.every=4",
    "checkpoints.dense_until=4",
    "checkpoints.sparse_every=4",
    "logger=csv",
]
TWO_PROCESSES = ["trainer.accelerator=cpu", "trainer.devices=2", "global_batch_size=8"]
ENV = {**os.environ, "WANDB_MODE": "offline"}


def losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r["train/loss"]}


def train(*args: str) -> None:
    result = run_cli("normlab-train", *RUN, *args)
    assert result.returncode == 0, result.stderr[-3000:]


def launch(command: list[str]) -> Command | subprocess.Popen:
    """normlab-train (its DDP ranks included) from conftest's preloading server; torchrun, which starts its own."""
    if command[0] == "normlab-train":
        return start_cli(*command)
    return subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def interrupted(commands: list[list[str]], run_dir: Path, at_step: int = 3) -> int:
    """Start `commands` (the processes of one launch), SIGTERM them all once `at_step` steps are logged, expect the
    save-and-stop exit (143), then start them again and let the run finish. Returns the step it resumed from."""
    processes = [launch(c) for c in commands]
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.csv").is_file() or len(losses(run_dir)) < at_step:
        if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
            for process in processes:
                process.kill()
            raise AssertionError(f"no step {at_step} logged: {processes[0].communicate()[1][-3000:]}")
        time.sleep(0.05)
    for process in processes:
        process.send_signal(signal.SIGTERM)
    errors = [p.communicate(timeout=300)[1] for p in processes]
    assert all(p.returncode != 0 for p in processes), errors[0][-3000:]
    stops = [line for line in errors[0].splitlines() if "error: SIGTERM: saved" in line]  # torchrun adds its own
    assert stops, errors[0][-3000:]
    stop = stops[-1]
    resumed_from = int(stop.split(" at step ")[1].split(";")[0])
    assert at_step <= resumed_from < STEPS
    results = [launch(c) for c in commands]
    for process in results:
        _, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]
    return resumed_from


def assert_same_losses(run: Path, reference: Path, tolerance: float = 0.0) -> None:
    mine, theirs = losses(run), losses(reference)
    assert sorted(mine) == sorted(theirs) == list(range(STEPS))
    assert all(mine[s] == pytest.approx(theirs[s], abs=tolerance, rel=0) for s in mine), (mine, theirs)


def assert_same_angles(run: Path, reference: Path, tolerance: float) -> None:
    mine, theirs = read_csv(run / "angles.csv"), read_csv(reference / "angles.csv")
    assert [(r["step"], r["layer"], r["site"], r["reference"]) for r in mine] == [
        (r["step"], r["layer"], r["site"], r["reference"]) for r in theirs]
    assert {r["step"] for r in mine} == {0, 4, 8}
    for a, b in zip(mine, theirs):
        assert a["count"] == b["count"]
        assert a["mean_deg"] == pytest.approx(b["mean_deg"], abs=tolerance)


def final_state(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def ddp(prepared, tmp_path_factory) -> Path:
    """The reference: 2 DDP processes over gloo, one micro-batch of 2 each, 2 accumulated: 8 sequences a step."""
    run = tmp_path_factory.mktemp("ddp") / "run"
    train(*TWO_PROCESSES, "strategy=ddp", f"run_dir={run}")
    return run


def test_fsdp_shards_block_by_block_and_trains_like_ddp_resuming_exactly(ddp, tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    train(*TWO_PROCESSES, "strategy=fsdp", f"run_dir={whole}")
    assert_same_losses(whole, ddp, tolerance=1e-5)  # the same computation, reduced in another order
    assert_same_angles(whole, ddp, tolerance=1e-3)
    assert read_csv(whole / "angles.csv")[:40] == read_csv(ddp / "angles.csv")[:40]  # step 0: the same weights

    # The checkpoint is the full state in the unsharded names: what DDP writes, what normlab-angles loads.
    sharded, replicated = final_state(whole), final_state(ddp)
    assert sharded.keys() == replicated.keys()
    # Adam divides by sqrt(v): rarely used embedding rows amplify the last bits of their gradients (DDP vs FSDP
    # reduce in another order) up to 2e-4 here, 1% of what 8 steps at lr 3e-3 may move a weight.
    assert all(torch.allclose(sharded[k], replicated[k], atol=1e-3) for k in sharded)
    module = build_module(compose_config("train", ["model.n_layer=2"]))
    module.load_state_dict(sharded)
    measured = run_cli("normlab-angles", f"model_path={whole / 'checkpoints' / 'last.ckpt'}", "probe.tokens=4096",
                       f"out={tmp_path / 'angles.csv'}")
    assert measured.returncode == 0, measured.stderr[-3000:]
    during_training = [r for r in read_csv(whole / "angles.csv") if r["step"] == STEPS]
    afterwards = read_csv(tmp_path / "angles.csv")
    assert len(afterwards) == len(during_training) and all(  # the sharded run's own probe, measured again
        a["mean_deg"] == pytest.approx(b["mean_deg"], abs=1e-6) for a, b in zip(afterwards, during_training))

    command = ["normlab-train", *RUN, *TWO_PROCESSES, "strategy=fsdp", f"run_dir={broken}"]
    assert interrupted([command], broken) >= 3
    assert_same_losses(broken, whole)  # exactly: resumed from its own sharded run's checkpoint
    assert all(torch.equal(final_state(broken)[k], v) for k, v in sharded.items())


def test_fsdp_units_are_the_transformer_blocks_and_the_rest_of_the_model(prepared):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from normlab.training.strategies import shard_by_block

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = build_module(compose_config("train", ["model.n_layer=3"])).model
        shard_by_block(model, init_device_mesh("cpu", (1,)))
        units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        assert units == ["", "blocks.0", "blocks.1", "blocks.2"]
        ids = torch.randint(0, 50257, (2, 16))
        assert model(ids, head=False).shape == (2, 16, 64)  # the angle probe's call gathers the root's parameters
    finally:
        dist.destroy_process_group()


def test_bf16_mixed_trains_on_the_cpu_and_resumes_exactly(prepared, tmp_path):
    fp32, whole, broken = tmp_path / "fp32", tmp_path / "whole", tmp_path / "broken"
    train(f"run_dir={fp32}")
    train("trainer.precision=bf16-mixed", f"run_dir={whole}")
    bf16, reference = losses(whole), losses(fp32)
    assert all(bf16[s] == pytest.approx(reference[s], abs=0.05) for s in reference)  # the same training...
    assert any(bf16[s] != reference[s] for s in reference)  # ...in bf16 matmuls
    command = ["normlab-train", *RUN, "trainer.precision=bf16-mixed", f"run_dir={broken}"]
    interrupted([command], broken)
    assert_same_losses(broken, whole)
    assert (broken / "angles.csv").read_bytes() == (whole / "angles.csv").read_bytes()


def test_fp16_mixed_trains_on_the_cpu_in_float16_with_clipping(prepared, tmp_path):
    """16-mixed on the CPU is float16 autocast with its loss scale, not Lightning's silent switch to bf16: the
    scaler's state rides in the full checkpoints, and the fused AdamW's gradients are clipped (the default 1.0)."""
    train("trainer.precision=16-mixed", "trainer.max_steps=4", f"run_dir={tmp_path}")  # float16 matmuls: slow on CPU
    assert sorted(losses(tmp_path)) == list(range(4)) and all(math.isfinite(v) for v in losses(tmp_path).values())
    scaler = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["FP16Mixed"]
    assert scaler["scale"] == 2.0**16 and scaler["_growth_tracker"] == 4  # no overflow in these steps


class ScaleRecorder(L.Callback):
    """Per optimizer step: the loss scale, the gradient norm the hooks see, whether the weights changed; and the
    gradient norm after the clipping (seen before the next step zeroes it)."""

    def __init__(self):
        self.scales, self.norms, self.clipped, self.updated = [], [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.weights = torch.cat([p.detach().flatten().clone() for p in pl_module.parameters()])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.scales.append(trainer.precision_plugin.scaler.get_scale())
        self.norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in pl_module.parameters()])))

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        if all(p.grad is not None for p in pl_module.parameters()):
            self.clipped.append(float(torch.nn.utils.get_total_norm([p.grad for p in pl_module.parameters()])))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        weights = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        self.updated.append(not torch.equal(self.weights, weights))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU"))])
def test_fp16_loss_scale_skips_overflows_clips_the_true_gradients_and_resumes(device, fused, tmp_path):
    """A loss scale far too high: the first steps overflow float16, and the scaler skips them (the weights stay
    as they are) and halves the scale, which NonFiniteGuard leaves to it; the steps that follow see and clip the
    unscaled gradients, with the fused AdamW too. A resumed run goes on at the scale saved."""
    steps, batch, scale = 10, 2, 2.0**24
    cfg = compose_config("train", [
        "model.n_layer=2", "model.vocab_size=256", f"data.batch_size={batch}", f"trainer.max_steps={steps}",
        f"trainer.accelerator={device}", "trainer.precision=16-mixed", f"optimizer.fused={fused}",
        "+trainer.enable_checkpointing=false", "logger=csv", f"run_dir={tmp_path}",
    ])
    windows = random_windows(cfg, (steps + 1) * batch)
    module, recorder = build_module(cfg), ScaleRecorder()
    trainer = build_trainer(cfg, [NonFiniteGuard(), recorder], 1)
    trainer.precision_plugin.scaler = torch.amp.GradScaler(device, init_scale=scale)
    trainer.fit(module, train_dataloaders=DataLoader(windows[:steps * batch], batch_size=batch))

    skipped = recorder.updated.index(True)
    assert skipped >= 2 and all(recorder.updated[skipped:])  # the overflows first, then every step applied
    assert recorder.scales[:skipped + 1] == [scale / 2**i for i in range(skipped + 1)]
    assert not any(map(math.isfinite, recorder.norms[:skipped]))
    # The first applied step starts from the initial weights: its gradients are those of float32, not scaled
    reference = build_module(cfg).model.to(device)
    x, y = (torch.stack([w[i] for w in windows[skipped * batch:(skipped + 1) * batch]]).to(device) for i in (0, 1))
    torch.nn.functional.cross_entropy(reference(x).flatten(0, 1), y.flatten()).backward()
    true_norm = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    assert recorder.norms[skipped] == pytest.approx(true_norm, rel=0.02) and true_norm > 1.0
    assert all(norm <= 1.0 + 1e-3 for norm in recorder.clipped[skipped:])  # trainer.gradient_clip_val=1.0

    trainer.save_checkpoint(tmp_path / "full.ckpt")
    saved = trainer.precision_plugin.scaler.get_scale()
    resumed = ScaleRecorder()
    cfg.trainer.max_steps = steps + 1
    trainer = build_trainer(cfg, [NonFiniteGuard(), resumed], 1)
    trainer.fit(build_module(cfg), train_dataloaders=DataLoader(windows, batch_size=batch),
                ckpt_path=tmp_path / "full.ckpt")
    assert resumed.scales == [saved] and saved != 2.0**16  # not a new scaler's


def test_the_guard_leaves_an_overflow_to_the_loss_scale_but_not_a_collapsed_scale_or_a_non_finite_loss():
    def trainer(plugin):
        one_rank = SimpleNamespace(reduce_boolean_decision=lambda decision, all: decision)
        return SimpleNamespace(precision_plugin=plugin, strategy=one_rank)

    def fp16(scale: float):
        return SimpleNamespace(scaler=torch.amp.GradScaler("cpu", init_scale=scale))

    guard, finite, nan = NonFiniteGuard(), torch.tensor([2.0, 3.0]), torch.tensor([2.0, float("nan")])
    assert guard.scaler_skips(trainer(fp16(2.0**16)), finite)
    assert not guard.scaler_skips(trainer(fp16(0.5)), finite)  # the gradients overflow float16 even unscaled
    assert not guard.scaler_skips(trainer(fp16(2.0**16)), nan)
    assert not guard.scaler_skips(trainer(Precision()), finite)  # float32, bf16: no scaler


def test_angle_statistics_are_computed_in_float32_under_bf16_autocast():
    """The probe's hooks see bf16 activations under autocast; their statistics must not be bf16 arithmetic."""
    torch.manual_seed(0)
    norm = LayerNorm(256)
    x = torch.randn(4, 32, 256) + 0.3  # a mean component: angles to 1 away from 90 degrees

    def statistics(autocast: bool) -> list[dict]:
        probe = AngleProbe([NormSite(0, "attn_norm", norm)], 256)
        with probe.hooks(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.no_grad():
            norm(x)
            probe.flush()
        return probe.stats.records(0)

    for exact, under_autocast in zip(statistics(False), statistics(True)):
        assert under_autocast["mean_deg"] == pytest.approx(exact["mean_deg"], abs=1e-4)
        assert under_autocast["std_deg"] == pytest.approx(exact["std_deg"], abs=1e-4)


def torchrun(node_rank: int, port: int, *args: str) -> list[str]:
    """One 'node' of a 2-node launch: torchrun with a static rendezvous, as a cluster runs it on each machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}",
            f"--rdzv-id=normlab-test-{port}", "-m", "normlab", *RUN, *args]


def test_two_nodes_split_the_global_batch_and_resume_like_one_process(prepared, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    train("global_batch_size=8", f"run_dir={one}")  # one process: 4 micro-batches of 2 per step
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = ["trainer.accelerator=cpu", "trainer.devices=1", "trainer.num_nodes=2", "global_batch_size=8"]
    interrupted([torchrun(rank, port, *nodes, f"run_dir={two}") for rank in (0, 1)], two)
    # 2 nodes x 1 process x 2 accumulated micro-batches: the same 8 sequences a step, each on one rank
    assert_same_losses(two, one, tolerance=1e-5)
    assert_same_angles(two, one, tolerance=1e-3)
    with open(two / "config.yaml") as f:
        assert "num_nodes: 2" in f.read()

    # Started again (a requeued job of a finished run): rank 0 sees it finished and exits at once; rank 1, which
    # may look only after that, must read the same and not wait for a claim that never comes.
    again = [subprocess.Popen(torchrun(rank, port + 1, *nodes, f"run_dir={two}"), env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [p.communicate(timeout=120)[0] for p in again]  # RANK_WAIT_SECONDS would be 600
    assert [p.returncode for p in again] == [0, 0], outputs
    assert f"{two} is finished (step {STEPS} of {STEPS}): nothing to do" in outputs[0]
