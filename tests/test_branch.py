"""Branches (training/branch.py, docs/branch.md) on cases whose answer is known: a branch of step K computes its
source's step-K function (kept, converted, or the zero-mean-writers control), sees the source's batches from K on,
keeps the source's step-K validation loss when its learning rate is 0, and the control tracks the LayerNorm branch to
float rounding (float64); a `-m` sweep of arms and steps, and a branch stopped by SIGTERM resumes to the end of the
uninterrupted one; what cannot be branched is one line. Real runs: the session's FAST_TRAIN sweep as sources, and a
longer one (14 steps) where a branch needs steps to follow."""

import errno
import itertools
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback

from conftest import FAST_TRAIN, compose_config, run_cli, run_of, start_cli
from normlab.common.errors import ConfigError
from normlab.interop.export import ExportError, hugging_face
from normlab.model.conversion import changed_by_centring
from normlab.training.loader import load_model
from normlab.training.pipeline import build_model, train
from normlab.training.rundir import checkpoints, directory
from normlab.training.rundir.checkpoints import read_checkpoint
from normlab.training.rundir.files import RunDirError, write_error
from test_faults import final_weights, finish, flip_bytes, logged_steps, metrics, resumed_step, wait_for

K = 4
ARMS = {"layernorm": [], "rmsnorm_bias": [], "control": ["norm=rmsnorm_bias", "branch.zero_mean_writers=true"]}
LONGER = ["trainer.max_steps=14", "checkpoints.sparse_every=14"]  # checkpoints at 0, 2, 4, then 14


@pytest.fixture(scope="module")
def longer(prepared, tmp_path_factory) -> Path:
    """A LayerNorm source of 14 FAST_TRAIN steps (float32)."""
    source = tmp_path_factory.mktemp("longer") / "source"
    result = run_cli("normlab-train", *FAST_TRAIN, *LONGER, f"run_dir={source}")
    assert result.returncode == 0, result.stderr
    return source


def branch_config(tmp_path: Path, source: Path, arm: str, *extra: str, step: int = K):
    overrides = ARMS.get(arm) or [f"norm={arm}"]
    return compose_config("train", [*FAST_TRAIN, *overrides, f"branch.source={source}", f"branch.step={step}",
                                    f"run_dir={tmp_path / arm}", *extra])


def val_losses(run: Path) -> dict[int, float]:
    """Optimizer step (1-based) -> validation loss, from metrics.csv."""
    lines = (run / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    column = header.index("val/loss")
    return {int(row.split(",")[0]) + 1: float(row.split(",")[column]) for row in lines[1:]
            if row.split(",")[column]}


class Batches(Callback):
    """The training batches a run sees, in order."""

    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(batch[0].clone())


def source_batches(start: int, count: int) -> list[torch.Tensor]:
    """The batches the FAST_TRAIN source sees at optimizer steps start.. (its data module, its sampler)."""
    dm = instantiate(compose_config("train", FAST_TRAIN).data)
    dm.setup("fit")
    return [x for x, _ in itertools.islice(dm.train_dataloader(), start, start + count)]


def test_every_arm_starts_with_the_sources_step_k_function_and_its_batches(sweep, tmp_path):
    source = run_of(sweep, "layernorm")
    tokens = source_batches(0, 1)[0]
    with torch.no_grad():
        expected = load_model(source / f"checkpoints/step-{K:07d}.ckpt")(tokens)
    source_val = val_losses(source)[K]
    for arm in ARMS:
        recorder = Batches()
        train(branch_config(tmp_path, source, arm), extra_callbacks=[recorder])
        first = tmp_path / arm / f"checkpoints/step-{K:07d}.ckpt"
        checkpoint = read_checkpoint(first)
        assert checkpoint["global_step"] == K and checkpoint["branched_from"]["step"] == K
        assert checkpoint["optimizer_states"][0]["state"] == {}  # a fresh AdamW: no moments
        with torch.no_grad():
            logits = load_model(first)(tokens)
        assert torch.allclose(logits, expected, atol=1e-4), arm  # the source's function of step K
        losses = val_losses(tmp_path / arm)
        assert min(losses) == K and losses[K] == pytest.approx(source_val, abs=1e-4)  # its first row: the start
        for seen, sources in zip(recorder.seen, source_batches(K, 2), strict=True):
            assert torch.equal(seen, sources)  # the source's batches from step K on
    with pytest.raises(ExportError, match="is a branch's zero-mean-writers control"):  # GPT-2 would not centre
        hugging_face(tmp_path / "control" / f"checkpoints/step-{K:07d}.ckpt")


def test_with_a_learning_rate_of_0_every_arm_keeps_the_sources_step_k_loss(sweep, tmp_path):
    source = run_of(sweep, "layernorm")
    for arm in ("layernorm", "rmsnorm_bias"):
        train(branch_config(tmp_path, source, arm, "optimizer.lr=0"))
        losses = val_losses(tmp_path / arm)
        assert sorted(losses) == [4, 6]
        assert all(loss == pytest.approx(val_losses(source)[K], abs=1e-4) for loss in losses.values()), arm


def test_the_zero_mean_writers_control_tracks_the_layernorm_branch_in_float64(longer, tmp_path):
    """Its gradients with respect to the raw weights are the LayerNorm model's, and the optimizer starts afresh for
    both: over the steps after K their losses agree to float64 rounding, where the free RMSNorm branch's do not."""
    losses = {}
    for arm in ARMS:
        train(branch_config(tmp_path, longer, arm, *LONGER, "trainer.precision=64-true"))
        losses[arm] = val_losses(tmp_path / arm)
    after = [s for s in losses["layernorm"] if s > K]
    assert len(after) == 5
    assert max(abs(losses["control"][s] - losses["layernorm"][s]) for s in after) < 1e-6
    assert max(abs(losses["rmsnorm_bias"][s] - losses["layernorm"][s]) for s in after) > 1e-4


def test_a_sweep_of_arms_and_steps_and_a_branch_stopped_by_sigterm_resumes_to_the_same_end(longer, tmp_path):
    """`-m norm=layernorm,rmsnorm_bias branch.step=2,4`: four branches, each from its step to the end. The converted
    branch of step 2 started again and stopped by SIGTERM mid-run: exit 143, its step saved; the same command resumes
    from that step and ends as the sweep's: metrics.csv row for row, the final weights bit for bit."""
    branch = [*FAST_TRAIN, *LONGER, f"branch.source={longer}"]
    result = run_cli("normlab-train", "-m", *branch, "norm=layernorm,rmsnorm_bias", "branch.step=2,4",
                     f"paths.output_dir={tmp_path}", "experiment_name=b", "run_name=${norm.name}-K${branch.step}")
    assert result.returncode == 0, result.stderr[-3000:]
    for arm, k in itertools.product(("layernorm", "rmsnorm_bias"), (2, 4)):
        assert sorted(val_losses(tmp_path / "b" / f"{arm}-K{k}")) == list(range(k, 15, 2)), (arm, k)

    stopped = tmp_path / "stopped"
    command = [*branch, "norm=rmsnorm_bias", "branch.step=2", f"run_dir={stopped}"]
    process = start_cli("normlab-train", *command)
    assert wait_for(process, lambda: logged_steps(stopped) >= 3)  # steps 3-5 of 14
    process.send_signal(signal.SIGTERM)
    finish(process, 128 + signal.SIGTERM)
    at = logged_steps(stopped) + 2  # rows from step K = 2 on
    moved = longer.with_name("moved")
    longer.rename(moved)  # the source moved meanwhile: the branch resumes from its own checkpoints
    try:
        err = finish(start_cli("normlab-train", *command))
    finally:
        moved.rename(longer)
    assert resumed_step(err, stopped) == at and 2 < at < 14
    assert metrics(stopped) == metrics(tmp_path / "b" / "rmsnorm_bias-K2")  # every step once, the same losses
    reference, weights = final_weights(tmp_path / "b" / "rmsnorm_bias-K2"), final_weights(stopped)
    assert all(torch.equal(tensor, weights[name]) for name, tensor in reference.items())

    for checkpoint in (stopped / "checkpoints").glob("*.ckpt"):
        flip_bytes(checkpoint)  # no intact checkpoint left: never a fresh start at step 0
    result = run_cli("normlab-train", *command)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and f"{stopped} has no intact full checkpoint" in last, result.stderr[-3000:]
    assert last.endswith("restart=true moves this run aside and starts over")  # for a branch: from its source again


def test_kept_moments_are_the_sources_bit_for_bit_for_every_parameter_the_conversion_leaves_unchanged(sweep, tmp_path):
    """branch.moments=kept, in every arm alike: the branch's first checkpoint holds the source's AdamW state of step K
    (its full checkpoint of that step, previous.ckpt, where the scheduled one holds the weights only) for every
    parameter but the embeddings and output projections, which start anew; the same parameters in every arm."""
    source = run_of(sweep, "layernorm")
    moments = read_checkpoint(source / "checkpoints" / "previous.ckpt")
    assert moments["global_step"] == K and not read_checkpoint(source / f"checkpoints/step-{K:07d}.ckpt").get(
        "optimizer_states")  # only previous.ckpt holds them
    sources = moments["optimizer_states"][0]["state"]
    kept_by_arm = {}
    for arm in ARMS:
        cfg = branch_config(tmp_path, source, arm, "branch.moments=kept", "trainer.max_steps=6")
        train(cfg)
        first = read_checkpoint(tmp_path / arm / f"checkpoints/step-{K:07d}.ckpt")
        assert first["branched_from"]["checkpoint"] == "previous.ckpt"
        state = first["optimizer_states"][0]["state"]
        names = optimizer_order(cfg)
        assert len(names) == len(sources) and state  # the source had moments for every parameter
        for index, name in enumerate(names):
            if changed_by_centring(name):
                assert index not in state, (arm, name)
            else:
                assert state[index].keys() == sources[index].keys(), (arm, name)
                for key, value in sources[index].items():
                    assert torch.equal(state[index][key], value) and state[index][key].dtype == value.dtype, (arm, key)
        kept_by_arm[arm] = sorted(state)
    assert kept_by_arm["layernorm"] == kept_by_arm["rmsnorm_bias"] == kept_by_arm["control"]
    assert {changed_by_centring(n) for n in names} == {True, False}
    with pytest.raises(ConfigError, match=r"branch.moments=maybe: give fresh \(a new AdamW in every arm\) or kept"):
        train(branch_config(tmp_path, source, "layernorm", "branch.moments=maybe", f"run_dir={tmp_path / 'bad'}"))
    assert not (tmp_path / "bad").exists()


def test_a_tied_source_branches_with_every_arms_head_untied_from_its_matrix(prepared, tmp_path):
    """A source whose head is its embedding (model=9m's): the conversion centres the embedding, so a converted arm that
    keeps the head tied is refused in one line, nothing written; with model.tie_embeddings=false (every arm alike)
    each arm starts from the source's step-K function, its head the source's matrix, and keeps the source's moments
    bit for bit for every parameter but the embeddings, the output projections and the head it unties."""
    source, tied = tmp_path / "tied", ["model.tie_embeddings=true"]
    train(compose_config("train", [*FAST_TRAIN, *tied, f"run_dir={source}"]))
    with pytest.raises(ConfigError, match=r"ties its LM head to its embeddings, which the conversion centres: give "
                                          r"model.tie_embeddings=false to every arm of the branch alike"):
        train(branch_config(tmp_path, source, "rmsnorm_bias", *tied))
    assert not (tmp_path / "rmsnorm_bias").exists()
    tokens = source_batches(0, 1)[0]
    with torch.no_grad():
        expected = load_model(source / f"checkpoints/step-{K:07d}.ckpt")(tokens)
    sources = read_checkpoint(source / "checkpoints" / "previous.ckpt")["optimizer_states"][0]["state"]
    source_names = optimizer_order(compose_config("train", [*FAST_TRAIN, *tied]))
    assert "lm_head.weight" not in source_names and len(source_names) == len(sources)
    for arm in ARMS:
        cfg = branch_config(tmp_path, source, arm, "branch.moments=kept")
        train(cfg)
        first = tmp_path / arm / f"checkpoints/step-{K:07d}.ckpt"
        model = load_model(first)
        assert not model.config.tie_embeddings and model.lm_head.weight.data_ptr() != model.wte.weight.data_ptr()
        with torch.no_grad():
            assert torch.allclose(model(tokens), expected, atol=1e-4), arm  # the source's function of step K
        state, names = read_checkpoint(first)["optimizer_states"][0]["state"], optimizer_order(cfg)
        assert {names[i] for i in state} == {n for n in source_names if not changed_by_centring(n)}, arm
        for index in state:
            theirs = sources[source_names.index(names[index])]
            assert all(torch.equal(state[index][k], v) for k, v in theirs.items()), (arm, names[index])


def optimizer_order(cfg) -> list[str]:
    """The parameter names of a run's AdamW state, in the order of its indices (LanguageModel's two groups)."""
    named = list(build_model(cfg).named_parameters())
    return [n for n, p in named if p.dim() >= 2] + [n for n, p in named if p.dim() < 2]


def test_kept_moments_need_a_source_checkpoint_that_holds_them(sweep, tmp_path):
    source = source_copy(sweep, tmp_path)
    (source / "checkpoints" / "previous.ckpt").unlink()
    with pytest.raises(ConfigError, match=rf"branch.moments=kept: branch.source={source}'s checkpoint of step 4 "
                                          r"\(step-0000004.ckpt\) holds the weights only, without the optimizer's "
                                          "moments: branch a run trained with checkpoints.scheduled=full, or give "
                                          "branch.moments=fresh"):
        train(branch_config(tmp_path, source, "rmsnorm_bias", "branch.moments=kept"))
    assert not (tmp_path / "rmsnorm_bias").exists()


@pytest.mark.parametrize("arm, step, message", [
    ("layernorm", 3, "has no checkpoint of step 3 (its steps: 0, 2, 4, 6): give one of its steps as "
                     "branch.step"),
    ("layernorm", K, "branch.zero_mean_writers=true with norm=layernorm: the control arm is an RMSNorm model whose "
                     "writers are centred (norm=rmsnorm_bias, or rmsnorm for a LayerNorm without bias)"),
    ("layernorm", 6, "branch.step=6: give a step of the source's checkpoints from 1 to below trainer.max_steps=6"),
    ("rmsnorm", K, "norm=rmsnorm (bias False, eps 1e-05) is not the exact RMSNorm of"),
    ("dyt", K, "norm=dyt: a branch keeps its source's norm or converts its LayerNorms exactly into RMSNorms"),
])
def test_what_cannot_be_branched_is_one_line(sweep, tmp_path, arm, step, message):
    extra = ["branch.zero_mean_writers=true"] if "zero_mean_writers" in message else []
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        train(branch_config(tmp_path, run_of(sweep, "layernorm"), arm, *extra, step=step))
    assert not (tmp_path / arm).exists()  # nothing written


def test_a_source_of_another_norm_cannot_be_converted_and_a_setting_of_its_own_is_named(sweep, tmp_path):
    with pytest.raises(ConfigError, match="is already an RMSNorm model: nothing to convert"):
        train(branch_config(tmp_path, run_of(sweep, "rmsnorm"), "rmsnorm_bias"))
    train(compose_config("train", [*FAST_TRAIN, "norm=dyt", f"run_dir={tmp_path / 'dyt'}"]))
    with pytest.raises(ConfigError, match="has DyT norms: only a LayerNorm model converts exactly into an RMSNorm one; "
                                          "a branch of another norm than its source's needs a LayerNorm source"):
        train(branch_config(tmp_path, tmp_path / "dyt", "rmsnorm_bias"))
    with pytest.raises(ConfigError, match=r"^seed=1, where branch.source=.* has 0: a branch continues its source"):
        train(branch_config(tmp_path, run_of(sweep, "layernorm"), "rmsnorm_bias", "seed=1"))
    with pytest.raises(ConfigError, match="a branch needs both branch.source"):
        train(compose_config("train", [*FAST_TRAIN, f"branch.source={run_of(sweep, 'layernorm')}",
                                       f"run_dir={tmp_path / 'x'}"]))
    assert not (tmp_path / "rmsnorm_bias").exists() and not (tmp_path / "x").exists()


# -- the source: read once, checked as read, trusted over its config.yaml, recorded whole


def source_copy(sweep, tmp_path: Path) -> Path:
    """A copy of the session's LayerNorm run (checkpoints of steps 0, 2, 4, 6; previous.ckpt of step 4)."""
    return Path(shutil.copytree(run_of(sweep, "layernorm"), tmp_path / "source"))


def test_a_source_checkpoint_replaced_while_it_is_read_is_refused_never_taken_for_the_step_checked(
        sweep, tmp_path, monkeypatch):
    """Step 4 only in previous.ckpt, which a run still training replaces with step 6 between the reading of its
    digest file and of its bytes: the bytes read are checked against the digest, and refused; nothing is written."""
    source = source_copy(sweep, tmp_path)
    for name in ("step-0000004.ckpt", "step-0000004.ckpt.json"):
        (source / "checkpoints" / name).unlink()
    read_record = checkpoints.read_record

    def then_replaced(path: Path):
        record = read_record(path)
        if path.name == "previous.ckpt":  # as a save replaces a file: a new file renamed over it
            for name in ("last.ckpt", "last.ckpt.json"):
                shutil.copy(source / "checkpoints" / name, source / "checkpoints" / f".{name}.new")
            os.replace(source / "checkpoints" / ".last.ckpt.new", path)
            os.replace(source / "checkpoints" / ".last.ckpt.json.new", checkpoints.digest_path(path))
        return record

    monkeypatch.setattr(checkpoints, "read_record", then_replaced)
    with pytest.raises(ConfigError, match=r"^branch.source=.*: its checkpoint of step 4 cannot be read: "
                                          r".*previous.ckpt does not match the sha256 in its digest file \(its bytes "
                                          r"were corrupted, or it was replaced while it was read\); restore it"):
        train(branch_config(tmp_path, source, "layernorm"))
    assert not (tmp_path / "layernorm").exists()


def test_a_truncated_source_checkpoint_is_named_as_such(sweep, tmp_path):
    source = source_copy(sweep, tmp_path)
    (source / "checkpoints" / "previous.ckpt").unlink()
    with open(source / "checkpoints" / "step-0000004.ckpt", "r+b") as f:
        f.truncate(5000)
    with pytest.raises(ConfigError) as refused:
        train(branch_config(tmp_path, source, "layernorm"))
    assert str(refused.value).startswith(
        f"branch.source={source}: its checkpoint of step 4 cannot be read: {source}/checkpoints/step-0000004.ckpt "
        "holds 5,000 bytes, its digest file says ")
    assert str(refused.value).endswith("(truncated, or replaced while it was read); restore it, or give another of "
                                       "its steps as branch.step (0, 2, 6)")
    assert not (tmp_path / "layernorm").exists()


def test_the_source_checkpoints_config_is_trusted_over_its_config_yaml(sweep, tmp_path):
    """config.yaml saying d = 32 of a run whose checkpoints are 64 wide: a branch given d = 32 is told what the
    checkpoint holds (not a traceback of mismatched shapes); config.yaml not YAML at all does not stop a branch, which
    records its source as an absolute path with its run id."""
    source = source_copy(sweep, tmp_path)
    saved = (source / "config.yaml").read_text()
    (source / "config.yaml").write_text(saved.replace("n_embd: 64", "n_embd: 32"))
    with pytest.raises(ConfigError) as refused:
        train(branch_config(tmp_path, source, "layernorm", "model.n_embd=32"))
    assert str(refused.value) == (
        f"model.n_embd=32, where branch.source={source}'s checkpoint step-0000004.ckpt has 64 (its config.yaml says "
        "32: the checkpoint is what a branch starts from): a branch continues its source, so only its norm (and its "
        "optimizer's settings) may differ: give the source's")
    assert not (tmp_path / "layernorm").exists()

    (source / "config.yaml").write_text("model: [64\n")
    relative = os.path.relpath(source)
    train(branch_config(tmp_path, Path(relative), "layernorm"))
    branched = read_checkpoint(tmp_path / "layernorm" / "checkpoints" / "step-0000004.ckpt")["branched_from"]
    assert branched == {"source": str(source.resolve()), "run_id": (source / "run_id").read_text().strip(),
                        "step": 4, "checkpoint": "step-0000004.ckpt"}
    assert f"source: {source.resolve()}" in (tmp_path / "layernorm" / "config.yaml").read_text()


def test_a_branch_whose_first_checkpoint_met_a_full_disk_starts_again(sweep, tmp_path, monkeypatch):
    """The branch's config is written before its first checkpoints: a disk that fills while they are written fails
    the start in one line, and the same command, once space is freed, resumes the branch from what was written."""
    real = directory.write_checkpoint

    def full_disk(checkpoint, path):  # the step's checkpoint written, then the disk full for last.ckpt
        if path.name == "last.ckpt":
            raise write_error(path, OSError(errno.ENOSPC, "No space left on device"))
        return real(checkpoint, path)

    monkeypatch.setattr(directory, "write_checkpoint", full_disk)
    with pytest.raises(RunDirError, match="^no space left on device while writing .*last.ckpt"):
        train(branch_config(tmp_path, run_of(sweep, "layernorm"), "rmsnorm_bias"))
    assert [p.name for p in (tmp_path / "rmsnorm_bias" / "checkpoints").glob("*.ckpt")] == ["step-0000004.ckpt"]
    monkeypatch.setattr(directory, "write_checkpoint", real)
    train(branch_config(tmp_path, run_of(sweep, "layernorm"), "rmsnorm_bias"))
    assert read_checkpoint(tmp_path / "rmsnorm_bias" / "checkpoints" / "last.ckpt")["global_step"] == 6
