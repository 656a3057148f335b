"""The README's table of bad input, row by row, through the real `normlab-train`: one line on stderr that says
what to fix, exit code 2, and nothing on disk created, changed or removed."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import FAST_TRAIN, run_cli


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
def finished_run(prepared, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    result = run_cli("normlab-train", f"run_dir={run}", *FAST_TRAIN)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def earlier_run(run: Path, finished: Path) -> None:
    shutil.copytree(finished, run)


def checkpoints_without_config(run: Path, finished: Path) -> None:
    earlier_run(run, finished)
    (run / "config.yaml").unlink()


# id: (arguments, what to do first to the data copy or the run directory, extra environment, expected fragments)
CASES = {
    "unknown model": (["model=7m"], None, {}, ["unknown model '7m': choose one of 160m, 1b, 410m, 70m, tiny"]),
    "unknown norm in a sweep": (["-m", "norm=layernorm,batchnorm"], None, {}, ["unknown norm 'batchnorm'", "layernorm, rmsnorm"]),
    "unknown experiment": (["experiment=paper_7b"], None, {}, ["unknown experiment 'paper_7b'", "paper_410m"]),
    "heads do not divide the width": (["model.n_head=5"], None, {}, ["model.n_embd=64 is not divisible by model.n_head=5"]),
    "global batch does not divide": (["experiment=paper_70m", "trainer.devices=3"], None, {},
                                     ["global_batch_size=64 is not a multiple of data.batch_size=2 x trainer.devices=3"]),
    "Slurm tasks != devices": ([], None, {"SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NAME": "train"},
                               ["Slurm runs 4 tasks per node but trainer.devices=1", "--ntasks-per-node"]),
    "data not prepared": (["data.dir={tmp}/nothing"], None, {}, ["data 'embedded' is not prepared", "normlab-prepare data=embedded"]),
    "truncated token file": ([], truncate, {}, ["train.bin holds 500 tokens, its metadata says", "truncated"]),
    "corrupt token file": ([], out_of_vocabulary, {}, ["holds token 60000 at position 12345, outside the vocabulary"]),
    "checksum mismatch": (["data.verify_checksums=true"], changed_token, {}, ["train.bin does not match the sha256"]),
    "other tokenizer": ([], other_tokenizer, {}, ["tokenized with cl100k_base", "expects GPT-2"]),
    "probe smaller than asked": (["probe.tokens=10000000"], None, {}, ["fewer than the 10,000,000 asked", "lower probe.tokens"]),
    "val_tokens too large": (["data.val_tokens=10000000"], None, {}, ["data.val_tokens=10000000 but the validation split"]),
    "checkpoint step without validation": (["callbacks.scheduled_checkpoints.every=3"], None, {},
                                           ["checkpoint step 3 is not a validation step (trainer.val_check_interval=2)"]),
    "unwritable output directory": (["run_dir={tmp}/a-file/run"], None, {},
                                    ["cannot write the output directory", "a-file: not a directory", "writable run_dir="]),
    "resume with a changed model shape": (["model.n_embd=32"], earlier_run, {},
                                          ["holds checkpoints of another config (model.n_embd: 64 -> 32)", "restart=true"]),
    "checkpoints without config.yaml": ([], checkpoints_without_config, {}, ["holds checkpoints but no config.yaml"]),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(case, prepared, finished_run, tmp_path):
    args, damage, env, fragments = CASES[case]
    data, run = Path(shutil.copytree(prepared, tmp_path / "embedded")), tmp_path / "run"
    (tmp_path / "a-file").write_text("a file where a directory is expected\n")
    if damage in (earlier_run, checkpoints_without_config):
        damage(run, finished_run)  # a copy of a finished run: its run_dir inside config.yaml differs, as for a moved run
    elif damage:
        damage(data)
    before = snapshot(tmp_path)

    result = run_cli("normlab-train", f"run_dir={run}", f"data.dir={data}", f"probe.dir={data}", *FAST_TRAIN,
                     *[a.format(tmp=tmp_path) for a in args], env=env)

    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("normlab-train: error: ")
    for fragment in fragments:
        assert fragment in line
    assert snapshot(tmp_path) == before
