"""docs/errors.md's table of bad input, row by row, through the real `normlab-train`: one line on stderr that says
what to fix, exit code 2, and nothing on disk created, changed or removed."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import BIN, FAST_TRAIN, run_cli, run_of


def snapshot(root: Path) -> dict:
    return {p: p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def truncate(data: Path) -> None:
    with open(data / "train.bin", "r+b") as f:
        f.truncate(1000)


def out_of_vocabulary(data: Path) -> None:
    tokens = np.memmap(data / "train.bin", dtype=np.uint16, mode="r+")
    tokens[12345] = 60000
    tokens.flush()


def changed_token(data: Path) -> None:
    tokens = np.memmap(data / "train.bin", dtype=np.uint16, mode="r+")
    tokens[100] = (int(tokens[100]) + 1) % 50000  # same size, still in the vocabulary: only the checksum can tell
    tokens.flush()


def other_tokenizer(data: Path) -> None:
    meta = json.loads((data / "meta.json").read_text())
    meta["tokenizer"].update(name="cl100k_base", vocab_size=100277, ranks_sha256="0" * 64)
    (data / "meta.json").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def finished_run(sweep) -> Path:
    """The session's finished LayerNorm run of FAST_TRAIN (the cases that need an earlier run damage a copy)."""
    return run_of(sweep, "layernorm")


def empty_meta(data: Path) -> None:
    (data / "meta.json").write_text("[]")


def meta_without_splits(data: Path) -> None:
    meta = json.loads((data / "meta.json").read_text())
    del meta["splits"]
    (data / "meta.json").write_text(json.dumps(meta))


def earlier_run(run: Path, finished: Path) -> None:
    shutil.copytree(finished, run)


def checkpoints_without_config(run: Path, finished: Path) -> None:
    earlier_run(run, finished)
    (run / "config.yaml").unlink()


def damaged_config(run: Path, finished: Path) -> None:
    earlier_run(run, finished)
    (run / "config.yaml").write_text("seed: [0\nmodel: {")


def damaged_full_checkpoints(run: Path, finished: Path) -> None:
    earlier_run(run, finished)
    for name in ("last.ckpt", "previous.ckpt"):
        with open(run / "checkpoints" / name, "r+b") as f:
            f.truncate(5000)


# id: (arguments, what to do first to the data copy or the run directory, extra environment, expected fragments)
CASES = {
    "unknown model": (["model=7m"], None, {}, ["unknown model '7m': choose one of 160m, 1b, 410m, 70m, 9m, tiny"]),
    "unknown norm in a sweep": (
        ["-m", "norm=layernorm,batchnorm"],
        None,
        {},
        ["unknown norm 'batchnorm'", "layernorm, layernorm_nobias, rmsnorm, rmsnorm_bias"],
    ),
    "unknown experiment": (["experiment=paper_7b"], None, {}, ["unknown experiment 'paper_7b'", "paper_410m"]),
    "heads do not divide the width": (
        ["model.n_head=5"],
        None,
        {},
        ["model.n_embd=64 is not divisible by model.n_head=5"],
    ),
    "global batch does not divide": (
        ["experiment=paper_70m", "trainer.accelerator=cpu", "trainer.devices=3"],
        None,
        {},
        ["global_batch_size=64 is not a multiple of data.batch_size=2 x trainer.devices=3"],
    ),
    "Slurm tasks != devices": (
        [],
        None,
        {"SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NAME": "train"},
        ["Slurm runs 4 tasks per node but trainer.devices=1", "--ntasks-per-node"],
    ),
    "data not prepared": (
        ["data.dir={tmp}/nothing"],
        None,
        {},
        ["data 'embedded' is not prepared", "normlab-prepare data=embedded"],
    ),
    "truncated token file": ([], truncate, {}, ["train.bin holds 500 tokens, its metadata says", "truncated"]),
    "corrupt token file": ([], out_of_vocabulary, {}, ["holds token 60000 at position 12345, outside the vocabulary"]),
    "checksum mismatch": (["data.verify_checksums=true"], changed_token, {}, ["train.bin does not match the sha256"]),
    "other tokenizer": ([], other_tokenizer, {}, ["tokenized with cl100k_base", "expects GPT-2"]),
    "probe smaller than asked": (
        ["probe.tokens=10000000"],
        None,
        {},
        ["fewer than the 10,000,000 asked", "lower probe.tokens"],
    ),
    "val_tokens too large": (
        ["data.val_tokens=10000000"],
        None,
        {},
        ["data.val_tokens=10000000 but the validation split"],
    ),
    "checkpoint step without validation": (
        ["checkpoints.every=3"],
        None,
        {},
        ["checkpoint step 3 is not a validation step (trainer.val_check_interval=2)"],
    ),
    "unwritable output directory": (
        ["run_dir={tmp}/a-file/run"],
        None,
        {},
        ["cannot write the output directory", "a-file: not a directory", "writable run_dir="],
    ),
    "resume with a changed model shape": (
        ["model.n_embd=32"],
        earlier_run,
        {},
        ["holds checkpoints of another config (model.n_embd: 64 -> 32)", "restart=true"],
    ),
    "checkpoints without config.yaml": ([], checkpoints_without_config, {}, ["holds checkpoints but no config.yaml"]),
    "damaged config.yaml": ([], damaged_config, {}, ["config.yaml is damaged (", "restore it, or restart=true"]),
    "no intact full checkpoint": (
        [],
        damaged_full_checkpoints,
        {},
        ["has no intact full checkpoint to resume from", "restart=true moves this run aside"],
    ),
    "seed not a number": (["seed=abc"], None, {}, ["seed=abc: give a whole number from 0 to 2**32 - 1"]),
    "negative seed": (["seed=-1"], None, {}, ["seed=-1: give a whole number from 0 to 2**32 - 1"]),
    "negative learning rate": (
        ["optimizer.lr=-1"],
        None,
        {},
        ["optimizer.lr=-1: give a learning rate >= 0"],
    ),
    "infinite learning rate": (["optimizer.lr=inf"], None, {}, ["optimizer.lr=inf: give a finite number"]),
    "infinite learning rate, its old key": (["model.lr=inf"], None, {}, ["optimizer.lr=inf: give a finite number"]),
    "not-a-number learning rate": (["optimizer.lr=nan"], None, {}, ["optimizer.lr=nan: give a finite number"]),
    "infinite Adam beta": (["optimizer.betas=[0.9,-inf]"], None, {}, ["optimizer.betas[1]=-inf: give a finite"]),
    "not-a-number weight decay": (["optimizer.weight_decay=nan"], None, {}, ["optimizer.weight_decay=nan: give a"]),
    "infinite dropout": (["model.dropout=inf"], None, {}, ["model.dropout=inf: give a finite number"]),
    "infinite gradient clipping": (
        ["trainer.gradient_clip_val=inf"],
        None,
        {},
        ["trainer.gradient_clip_val=inf: give a finite number"],
    ),
    "negative gradient clipping": (
        ["trainer.gradient_clip_val=-1"],
        None,
        {},
        ["trainer.gradient_clip_val=-1: give a number >= 0 (0 or null: no clipping)"],
    ),
    "deterministic neither true nor false": (
        ["trainer.deterministic=maybe"],
        None,
        {},
        ["trainer.deterministic=maybe: give true (torch's deterministic algorithms), warn (only warn where an "
         "operation has none), false or null"],
    ),
    "warm-up beyond the run": (
        ["schedule.warmup_fraction=1.5"],
        None,
        {},
        ["schedule.warmup_fraction=1.5: give a number between 0 and 1"],
    ),
    "negative minimum lr": (
        ["schedule.min_lr_ratio=-0.1"],
        None,
        {},
        ["schedule.min_lr_ratio=-0.1: give a number between 0 and 1"],
    ),
    "no validation interval": (
        ["trainer.val_check_interval=0"],
        None,
        {},
        ["trainer.val_check_interval=0: give a positive whole number"],
    ),
    "no checkpoint interval": (
        ["checkpoints.every=0"],
        None,
        {},
        ["checkpoints.every=0: give a positive number of steps"],
    ),
    "negative progress seconds": (
        ["callbacks.throughput.print_every_seconds=-1"],
        None,
        {},
        ["callbacks.throughput.print_every_seconds=-1: give a number of seconds >= 0, or null for lines by steps only"],
    ),
    "empty batch": (
        ["data.batch_size=0"],
        None,
        {},
        ["data.batch_size=0: give a positive number of sequences per device"],
    ),
    "negative validation tokens": (
        ["data.val_tokens=-5"],
        None,
        {},
        ["data.val_tokens=-5: validation needs at least one"],
    ),
    "no validation tokens": (
        ["data.val_tokens=0"],
        None,
        {},
        ["data.val_tokens=0: validation needs at least one sequence"],
    ),
    "no probe tokens": (
        ["probe.tokens=0"],
        None,
        {},
        ["probe.tokens=0 is less than one sequence of the model's context"],
    ),
    "probe shorter than a sequence": (["probe.tokens=100"], None, {}, ["probe.tokens=100 is less than one sequence"]),
    "batch larger than the data": (
        ["data.batch_size=20000"],
        None,
        {},
        ["an optimizer step takes 20000 sequences of 128 tokens, but the training split"],
    ),
    "GPU asked on a machine without": (
        ["trainer=gpu"],
        None,
        {},
        ["trainer.accelerator=gpu but this machine has no GPU"],
    ),
    "unknown model key": (["+model.n_layers=2"], None, {}, ["unknown key model.n_layers (added with +?)"]),
    "unknown data key": (
        ["+data.shuffle=true"],
        None,
        {},
        ["unknown key data.shuffle", "TokenDataModule has no parameter"],
    ),
    "unknown optimizer key": (
        ["+optimizer.momentum=0.9"],
        None,
        {},
        ["unknown key optimizer.momentum", "torch.optim.AdamW"],
    ),
    "Adam beta of 1.5": (["optimizer.betas=[0.9,1.5]"], None, {}, ["optimizer.betas=[0.9, 1.5]: give two numbers"]),
    "norm setting not a number": (
        ["norm=dyt", "norm.layer.alpha_init=abc"],
        None,
        {},
        ["norm.layer.alpha_init=abc: give a number"],
    ),
    "empty run_dir": (["run_dir="], None, {}, ["run_dir is empty: give the run's directory"]),
    "meta.json not an object": ([], empty_meta, {}, ["meta.json is malformed (a JSON list, not an object)"]),
    "meta.json without splits": ([], meta_without_splits, {}, ["meta.json is malformed (no 'splits' object)"]),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(case, prepared, finished_run, tmp_path):
    args, damage, env, fragments = CASES[case]
    data, run = Path(shutil.copytree(prepared, tmp_path / "embedded")), tmp_path / "run"
    (tmp_path / "a-file").write_text("a file where a directory is expected\n")
    if damage in (earlier_run, checkpoints_without_config, damaged_config, damaged_full_checkpoints):
        damage(
            run, finished_run
        )  # a copy of a finished run: its run_dir inside config.yaml differs, as for a moved run
    elif damage:
        damage(data)
    before = snapshot(tmp_path)

    run_dir = [] if "run_dir=" in args else [f"run_dir={run}"]
    result = run_cli(
        "normlab-train",
        *run_dir,
        f"data.dir={data}",
        f"probe.dir={data}",
        *FAST_TRAIN,
        *[a.format(tmp=tmp_path) for a in args],
        env=env,
    )

    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("normlab-train: error: ")
    for fragment in fragments:
        assert fragment in line
    assert snapshot(tmp_path) == before


def test_unreadable_token_file_is_one_line_exit_2_and_changes_nothing(prepared, tmp_path):
    """Root reads any file: the run drops root's capabilities (setpriv), so that permission bits apply to it."""
    data, run = Path(shutil.copytree(prepared, tmp_path / "embedded")), tmp_path / "run"
    (data / "train.bin").chmod(0)
    before = snapshot(tmp_path)
    without_root_powers = ["setpriv", "--bounding-set=-all", "--"] if os.geteuid() == 0 else []
    result = subprocess.run(
        [
            *without_root_powers,
            str(BIN / "normlab-train"),
            f"run_dir={run}",
            f"data.dir={data}",
            f"probe.dir={data}",
            *FAST_TRAIN,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"normlab-train: error: cannot read {data}/train.bin (Permission denied): check its permissions"
    ]
    assert snapshot(tmp_path) == before
