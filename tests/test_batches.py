"""Training batches: every window once per epoch across ranks, and exact resume mid-epoch."""

import hashlib
import json

import lightning as L
import pytest
import torch
from hydra.utils import instantiate

from conftest import compose_config, local_corpus_config
from normlab.data.datamodule import ResumableLoader, ShuffledWindows
from normlab.training.pipeline import build_module


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_share_each_epoch_with_no_overlap_and_no_gap(world_size):
    windows, batch = 103, 4
    for epoch in (0, 1):
        ranks = [ShuffledWindows(windows, batch, seed=5, rank=r, world_size=world_size) for r in range(world_size)]
        for sampler in ranks:
            sampler.set_epoch(epoch)
        streams = [list(s) for s in ranks]
        assert len({len(s) for s in streams}) == 1  # ranks stay in step
        # global batch g = micro-batch g of rank 0, then of rank 1, ...: the permutation itself, in order
        interleaved = [
            w for g in range(len(streams[0]) // batch) for s in streams for w in s[g * batch : (g + 1) * batch]
        ]
        order = ranks[0].order(epoch)
        usable = windows // (batch * world_size) * batch * world_size
        assert interleaved == order[:usable].tolist()
        assert len(set(interleaved)) == usable and windows - usable < batch * world_size
    assert sorted(ShuffledWindows(windows, 1, seed=5)) == list(range(windows))  # batch 1, one rank: all of them


def test_loader_state_continues_the_epoch_where_it_stopped():
    dataset = list(range(40))
    first = ResumableLoader(dataset, batch_size=4, sampler=ShuffledWindows(40, 4, seed=1))
    first.sampler.set_epoch(2)
    full = [b.tolist() for b in first]
    first.steps_done = lambda: 2 * len(first) + 3  # optimizer steps (of 1 batch) done: 2 epochs, then 3
    resumed = ResumableLoader(dataset, batch_size=4, sampler=ShuffledWindows(40, 4, seed=1))
    resumed.load_state_dict(first.state_dict())
    resumed.sampler.set_epoch(2)  # Lightning sets the epoch it resumes: the position is kept
    assert [b.tolist() for b in resumed] == full[3:]


class Recorder(L.Callback):
    """Records (step, hash of the batch, loss) of every training step; optionally stops after `stop_at`."""

    def __init__(self, stop_at=None, checkpoint=None):
        self.steps, self.stop_at, self.checkpoint = [], stop_at, checkpoint

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        digest = hashlib.sha256(batch[0].numpy().tobytes()).hexdigest()[:16]
        self.steps.append((trainer.global_step, trainer.current_epoch, digest, outputs["loss"].item()))
        if trainer.global_step == self.stop_at:
            trainer.save_checkpoint(self.checkpoint)
            trainer.should_stop = True


def fit(cfg, recorder, ckpt_path=None):
    trainer = instantiate(
        cfg.trainer,
        callbacks=[recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(build_module(cfg), datamodule=instantiate(cfg.data), ckpt_path=ckpt_path)
    return recorder.steps


def test_resume_mid_epoch_continues_the_exact_sequence(local_corpus, tmp_path):
    tokens = json.loads((local_corpus / "meta.json").read_text())["splits"]["train"]["tokens"]
    per_epoch = (tokens - 1) // 64 // 4  # batches of 4 windows of 64 tokens
    cfg = compose_config(
        "train",
        [
            *local_corpus_config(local_corpus),
            "model.n_layer=1",
            "model.block_size=64",
            "data.batch_size=4",
            "data.val_tokens=64",
            f"trainer.max_steps={5 * per_epoch // 2}",
            f"run_dir={tmp_path}",
        ],
    )
    uninterrupted = fit(cfg, Recorder())
    epochs = [e for _, e, _, _ in uninterrupted]
    assert epochs[-1] == 2  # the run crosses two epoch boundaries
    stop = epochs.index(2) - per_epoch // 2  # mid-epoch 1
    first = fit(cfg, Recorder(stop_at=stop, checkpoint=tmp_path / "mid.ckpt"))
    second = fit(cfg, Recorder(), ckpt_path=tmp_path / "mid.ckpt")
    assert [s[:3] for s in first + second] == [s[:3] for s in uninterrupted]  # same batches, same order
    assert [s[3] for s in first + second] == [s[3] for s in uninterrupted]  # and the same losses, bit for bit
    assert torch.load(tmp_path / "mid.ckpt", weights_only=False)["loops"]["fit_loop"]["state_dict"][
        "combined_loader"
    ] == [{"epoch": 1, "consumed": stop - per_epoch}]
