"""Paper-scale settings on CPU: the experiments compose and validate, the global batch is the same whatever
the number of devices, DDP reproduces the single-process run, FLOPs match torch's counter."""

import csv

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from conftest import FAST_TRAIN, compose_config, run_cli
from normlab.data.datamodule import ShuffledWindows
from normlab.model.gpt import GPT, GPTConfig
from normlab.model.norms import LayerNorm
from normlab.probe.table import read_csv
from normlab.training.pipeline import build_model, gradient_accumulation
from normlab.training.rundir.checkpoints import checkpoint_steps

PAPER = {  # experiment: (model, steps, GPUs, peak lr, parameters with LayerNorm)
    "paper_70m": ("70m", 100_000, 4, 1e-3, 70_902_784),
    "paper_160m": ("160m", 100_000, 4, 6e-4, 163_037_184),
    "paper_410m": ("410m", 50_000, 2, 3e-4, 406_286_336),
    "paper_1b": ("1b", 50_000, 4, 3e-4, 1_013_686_272),
}


@pytest.mark.parametrize("experiment", PAPER)
def test_paper_experiments_compose_and_validate_without_allocating_weights(experiment):
    model, steps, gpus, lr, params = PAPER[experiment]
    cfg = compose_config("train", [f"experiment={experiment}", "norm=layernorm"])
    assert (cfg.model.name, cfg.trainer.max_steps, cfg.trainer.devices, cfg.optimizer.lr) == (model, steps, gpus, lr)
    assert cfg.trainer.precision == "bf16-mixed" and cfg.trainer.strategy == "ddp" and cfg.model.block_size == 1024
    assert cfg.data.name == "openwebtext" and cfg.probe.split == "probe" and cfg.probe.tokens == 1_000_000
    accumulate = gradient_accumulation(cfg)
    assert cfg.data.batch_size * cfg.trainer.devices * cfg.trainer.num_nodes * accumulate == 64
    schedule = checkpoint_steps(
        steps, **{k: cfg.checkpoints[k] for k in ("every", "dense_until", "sparse_every")}
    )
    assert schedule == [0, *range(1000, 10_001, 1000), *range(20_000, steps + 1, 10_000)]
    assert cfg.schedule.warmup_fraction == 0.01 and cfg.schedule.min_lr_ratio == 0.1
    with torch.device("meta"):
        assert build_model(cfg).num_params() == params
    assert cfg.run_dir.endswith(f"/checkpoints/{experiment}/{model}-layernorm-seed0")


def test_global_batch_stays_64_on_other_hardware():
    two_nodes = compose_config("train", ["experiment=paper_70m", "trainer.num_nodes=2", "data.batch_size=8"])
    assert gradient_accumulation(two_nodes) == 1
    one_gpu = compose_config("train", ["experiment=paper_410m", "trainer.devices=1", "data.batch_size=16"])
    assert gradient_accumulation(one_gpu) == 4


def test_an_optimizer_step_sees_the_same_windows_whatever_the_device_split():
    def step_windows(world, accumulate, steps=5):
        micro = [
            list(ShuffledWindows(200, 4, seed=3, rank=r, world_size=world, accumulate=accumulate))
            for r in range(world)
        ]
        per_step = 4 * accumulate
        return [
            sorted(w for r in range(world) for w in micro[r][s * per_step : (s + 1) * per_step]) for s in range(steps)
        ]

    assert step_windows(1, 4) == step_windows(2, 2) == step_windows(4, 1)


def math_attention(q, k, v, is_causal=False, dropout_p=0.0):
    """Attention as explicit matrix products, so FlopCounterMode sees them (the fused CPU kernel is not counted)."""
    T = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")) if is_causal else scores
    return F.dropout(scores.softmax(-1), dropout_p) @ v


def test_flops_per_token_matches_torch_flop_counter(monkeypatch):
    model = GPT(GPTConfig(n_layer=3, n_head=4, n_embd=64, block_size=32, vocab_size=1000), LayerNorm)
    model.init_weights(0)
    monkeypatch.setattr(F, "scaled_dot_product_attention", math_attention)
    ids = torch.randint(0, 1000, (2, 32))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    assert counter.get_total_flops() == model.flops_per_token() * ids.numel()


def test_wandb_run_is_grouped_with_its_other_seeds_and_tagged():
    cfg = compose_config("train", ["experiment=paper_70m", "norm=rmsnorm", "seed=2"])
    assert cfg.logger.wandb.group == "paper_70m-70m-rmsnorm" and list(cfg.logger.wandb.tags) == [
        "rmsnorm", "70m", "seed2"]
    other = compose_config("train", ["experiment=paper_70m", "norm=rmsnorm", "seed=0", "optimizer.lr=1e-3"],
                           with_hydra=True)
    assert other.logger.wandb.group == "paper_70m-70m-rmsnorm-lr1e-3"  # another lr: another group
    assert cfg.logger.wandb.job_type == "train" and cfg.logger.wandb.project == "normlab"
    assert cfg.logger.wandb.id is None  # drawn when the run starts (training/rundir/), kept in <run_dir>/run_id


def step_losses(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r["train/loss"]}


def test_two_ddp_processes_reproduce_one_process_with_the_same_global_batch(prepared, tmp_path):
    common = [
        *FAST_TRAIN,
        "global_batch_size=4",
        "trainer.val_check_interval=3",
        "checkpoints.every=3",
        "checkpoints.dense_until=3",
    ]
    one = run_cli(
        "normlab-train",
        *common,
        f"run_dir={tmp_path / 'one'}",  # 1 process, 2 micro-batches per step
        "callbacks.throughput.peak_flops=1e11",
    )  # a made-up peak, so that MFU is logged on CPU too
    two = run_cli(
        "normlab-train",
        *common,
        f"run_dir={tmp_path / 'two'}",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.strategy=ddp",
    )  # 2 processes (gloo), 1 micro-batch each
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    losses_one, losses_two = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert sorted(losses_one) == sorted(losses_two) == list(range(6))
    for step in losses_one:
        assert losses_two[step] == pytest.approx(losses_one[step], abs=1e-5)
    with open(tmp_path / "one" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["train/mfu"]]
    flops_per_token = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=128), LayerNorm).flops_per_token()
    assert len(rows) == 6 and all(
        float(r["train/mfu"])
        == pytest.approx(float(r["train/tokens_per_sec_per_device"]) * flops_per_token / 1e11, rel=1e-5)
        for r in rows
    )
    angles_one, angles_two = read_csv(tmp_path / "one" / "angles.csv"), read_csv(tmp_path / "two" / "angles.csv")
    assert len(angles_one) == len(angles_two) and {r["step"] for r in angles_one} == {0, 3, 6}
    for a, b in zip(angles_one, angles_two):
        assert (a["step"], a["layer"], a["site"], a["reference"], a["count"]) == (
            b["step"],
            b["layer"],
            b["site"],
            b["reference"],
            b["count"],
        )
        assert b["mean_deg"] == pytest.approx(a["mean_deg"], abs=1e-4) and b["std_deg"] == pytest.approx(
            a["std_deg"], abs=1e-4
        )


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    def loss_and_grads(checkpointing):
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=300), LayerNorm)
        model.init_weights(0)
        model.activation_checkpointing = checkpointing
        ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}

    (loss_a, grads_a), (loss_b, grads_b) = loss_and_grads(False), loss_and_grads(True)
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-6, atol=1e-7)
    cfg = compose_config("train", ["experiment=paper_1b", "activation_checkpointing=true"])
    with torch.device("meta"):
        assert build_model(cfg).activation_checkpointing


@pytest.mark.parametrize("launcher,gpus", [("slurm_a6000", 4), ("slurm_a100", 4)])
def test_submitit_launcher_configs_compose(launcher, gpus):
    cfg = compose_config("train", [f"hydra/launcher={launcher}", "experiment=paper_70m"], with_hydra=True)
    launch = cfg.hydra.launcher
    assert launch._target_.endswith("SlurmLauncher") and launch.gpus_per_node == launch.tasks_per_node == gpus
    assert launch.max_num_timeout > 0 and launch.setup == ["source slurm/env.sh"]
