"""Bad input to `normlab-angles` and `normlab-report`, case by case through the real tools: one line on stderr
that says what is wrong and what to do, exit code 2, and nothing on disk created, changed or removed."""

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from conftest import FAST_TRAIN, run_cli
from test_angles import tiny_hf
from normlab.angles import read_csv

STEP_2 = "run/checkpoints/step-0000002.ckpt"
SCHEDULED_ONLY = shutil.ignore_patterns("last.ckpt*", "previous.ckpt*")  # large, and not analysed: left out of copies


def snapshot(root: Path) -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def inputs(prepared, tmp_path_factory) -> Path:
    """run/: a finished run; hf/: a tiny Hugging Face GPT-2 (a context of 64 tokens). Tests damage copies."""
    root = tmp_path_factory.mktemp("inputs")
    result = run_cli("normlab-train", f"run_dir={root / 'run'}", *FAST_TRAIN)
    assert result.returncode == 0, result.stderr[-3000:]
    tiny_hf("gpt2").save_pretrained(root / "hf")
    return root


def corrupt(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))  # same size: only the sha256 can tell


def truncate(path: Path) -> None:
    os.truncate(path, 1000)


def remove_digest(path: Path) -> None:
    path.with_name(f"{path.name}.json").unlink()


def damage_every_checkpoint(checkpoints: Path) -> None:
    for path in checkpoints.glob("step-*.ckpt"):
        corrupt(path)


def write(text: str):
    def replace(path: Path) -> None:
        path.write_text(text)
    return replace


def set_model_type(path: Path) -> None:
    path.write_text(path.read_text().replace('"model_type": "gpt2"', '"model_type": "bert"'))


def cut_mid_row(path: Path) -> None:
    data = path.read_bytes()
    last_row = data.rindex(b"\n", 0, len(data) - 1) + 1
    path.write_bytes(data[: (last_row + len(data)) // 2])  # a killed write: half of the last row there


def drop_a_field_of_line_3(path: Path) -> None:
    lines = path.read_text().split("\n")
    lines[2] = lines[2].rsplit(",", 1)[0]
    path.write_text("\n".join(lines))


def break_the_yaml(path: Path) -> None:
    path.write_text(path.read_text().replace("model:\n", "model: [\n", 1))


ANGLES, REPORT = "normlab-angles", "normlab-report"
# id: (tool, arguments, (what damages the copy, the path it damages) or None, expected fragments); {tmp}: the copy
CASES = {
    "missing path": (ANGLES, ["{tmp}/nothing"], None, ["{tmp}/nothing does not exist", "a run directory or a"]),
    "directory without checkpoints": (ANGLES, ["{tmp}/run/checkpoints"], None,
                                      ["no checkpoint (.ckpt or <run>/checkpoints/step-*.ckpt) at {tmp}/run/",
                                       "checkpoints: give a .ckpt, a run directory"]),
    "config.json not JSON": (ANGLES, ["{tmp}/hf"], (write('{"model_type": "gpt2",'), "hf/config.json"),
                             ["{tmp}/hf/config.json is not valid JSON (Expecting", "restore the model's config.json"]),
    "unsupported model type": (ANGLES, ["{tmp}/hf"], (set_model_type, "hf/config.json"),
                               ["{tmp}/hf: model type bert is not supported (supported: gpt2, gpt_neo"]),
    "corrupted checkpoint": (ANGLES, ["{tmp}/" + STEP_2], (corrupt, STEP_2),
                             [f"{STEP_2} does not match the sha256 in its digest file", "give another checkpoint"]),
    "truncated checkpoint": (ANGLES, ["{tmp}/" + STEP_2], (truncate, STEP_2),
                             [f"{STEP_2} holds 1,000 bytes, its digest file says", "truncated"]),
    "checkpoint without digest": (ANGLES, ["{tmp}/" + STEP_2], (remove_digest, STEP_2),
                                  ["has no digest file step-0000002.ckpt.json", "or the run directory"]),
    "no intact checkpoint in a run": (ANGLES, ["{tmp}/run"], (damage_every_checkpoint, "run/checkpoints"),
                                      ["no intact checkpoint in {tmp}/run/checkpoints: ", "(and 3 more damaged)",
                                       "train the run again"]),
    "seq-len beyond block_size": (ANGLES, ["{tmp}/run", "--seq-len", "256"], None,
                                  ["--seq-len 256 is beyond the context of {tmp}/run (128 tokens, model.block_size)",
                                   "give at most 128"]),
    "seq-len beyond n_positions": (ANGLES, ["{tmp}/hf", "--seq-len", "128"], None,
                                   ["(64 tokens, n_positions in config.json): give at most 64"]),
    "zero tokens": (ANGLES, ["{tmp}/run", "--tokens", "0"], None, ["argument --tokens: 0 is not positive"]),
    "fewer tokens than a sequence": (ANGLES, ["{tmp}/run", "--tokens", "100"], None,
                                     ["--tokens 100 is less than one sequence of 128 tokens", "smaller --seq-len"]),
    "zero batch size": (ANGLES, ["{tmp}/run", "--batch-size", "0"], None, ["--batch-size: 0 is not positive"]),
    "probe not prepared": (ANGLES, ["{tmp}/run", "--probe-dir", "{tmp}/nothing"], None,
                           ["data 'nothing' is not prepared", "normlab-prepare"]),
    "--out a directory": (ANGLES, ["{tmp}/run", "--out", "{tmp}/hf"], None,
                          ["--out {tmp}/hf is a directory: give a file name, e.g. {tmp}/hf/angles.csv"]),
    "--out with two paths": (ANGLES, ["{tmp}/run", "{tmp}/hf", "--out", "{tmp}/a.csv"], None,
                             ["--out names one CSV file: give one path with it"]),
    "unknown option": (ANGLES, ["{tmp}/run", "--verbose"], None, ["unrecognized arguments: --verbose"]),
    "angles.csv cut mid-row": (REPORT, ["{tmp}/run"], (cut_mid_row, "run/angles.csv"),
                               ["{tmp}/run/angles.csv, line ", "is cut short", "rerun the same normlab-train command",
                                "normlab-angles {tmp}/run --out {tmp}/run/angles.csv"]),
    "angles.csv row without a field": (REPORT, ["{tmp}/run"], (drop_a_field_of_line_3, "run/angles.csv"),
                                       ["{tmp}/run/angles.csv, line 3, has 15 fields, its header 16"]),
    "metrics.csv cut mid-row": (REPORT, ["{tmp}/run"], (cut_mid_row, "run/metrics.csv"),
                                ["{tmp}/run/metrics.csv, line ", "is cut short",
                                 "rerun the same normlab-train command, which repairs it"]),
    "config.yaml not YAML": (REPORT, ["{tmp}/run"], (break_the_yaml, "run/config.yaml"),
                             ["{tmp}/run/config.yaml is not valid YAML (line ", "restore it"]),
    "config.yaml not a run config": (REPORT, ["{tmp}/run"], (write("- a list\n"), "run/config.yaml"),
                                     ["config.yaml is not a normlab run config (no model.name, norm.name, seed)"]),
    "report of a missing path": (REPORT, ["{tmp}/nothing"], None, ["{tmp}/nothing does not exist"]),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(case, prepared, inputs, tmp_path):
    tool, args, damage, fragments = CASES[case]
    shutil.copytree(inputs, tmp_path, dirs_exist_ok=True, ignore=SCHEDULED_ONLY)
    if damage:
        function, path = damage
        function(tmp_path / path)
    before = snapshot(tmp_path)
    probe = ["--probe-dir", str(prepared)] if tool == ANGLES else []

    # in tmp_path, where normlab-angles writes checkpoints/angles/<name>.csv by default
    result = run_cli(tool, *probe, *[a.format(tmp=tmp_path) for a in args], cwd=tmp_path)

    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"{tool}: error: ")
    for fragment in fragments:
        assert fragment.format(tmp=tmp_path) in line
    assert snapshot(tmp_path) == before


def test_a_run_with_a_damaged_checkpoint_is_analysed_without_it(prepared, inputs, tmp_path):
    run = Path(shutil.copytree(inputs / "run", tmp_path / "run", ignore=SCHEDULED_ONLY))
    corrupt(run / "checkpoints/step-0000002.ckpt")

    out = tmp_path / "a.csv"
    result = run_cli(ANGLES, str(run), "--probe-dir", str(prepared), "--tokens", "256", "--out", str(out))

    assert result.returncode == 0, result.stderr[-3000:]
    (warning,) = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert "step-0000002.ckpt does not match the sha256" in warning and warning.endswith(": skipped")
    assert {r["step"] for r in read_csv(out)} == {0, 4, 6}
    assert "wrote" in result.stdout and "(3 checkpoints, 256 probe tokens)" in result.stdout
