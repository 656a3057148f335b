"""Bad input to `normlab-angles` and `normlab-report`, case by case through the real tools: one line on stderr
that says what is wrong and what to do, exit code 2, and nothing on disk created, changed or removed."""

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import run_cli, run_of
from normlab.probe.table import read_csv
from test_angles import tiny_hf

STEP_2 = "run/checkpoints/step-0000002.ckpt"
SCHEDULED_ONLY = shutil.ignore_patterns("last.ckpt*", "previous.ckpt*")  # large, and not analysed: left out of copies


def snapshot(root: Path) -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def inputs(sweep, tmp_path_factory) -> Path:
    """run/: a finished run (a copy of the session's LayerNorm run); hf/: a tiny Hugging Face GPT-2 (a context of 64
    tokens); pythia/: a tiny GPT-NeoX with Pythia's vocabulary size (another BPE than GPT-2's) and no tokenizer
    files. Tests damage copies."""
    root = tmp_path_factory.mktemp("inputs")
    shutil.copytree(run_of(sweep, "layernorm"), root / "run")
    tiny_hf("gpt2").save_pretrained(root / "hf")
    pythia = tiny_hf("gpt_neox")
    pythia.resize_token_embeddings(50304)
    pythia.save_pretrained(root / "pythia")
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


def name_a_class_off_the_path(path: Path) -> None:
    path.write_text(path.read_text().replace("normlab.model.norms.LayerNorm", "my_norms.ScaleNorm", 1))


ANGLES, REPORT = "normlab-angles", "normlab-report"
# id: (tool, arguments, (what damages the copy, the path it damages) or None, expected fragments); {tmp}: the copy
CASES = {
    "missing path": (ANGLES, ["model_path={tmp}/nothing"], None,
                     ["{tmp}/nothing does not exist", "a run directory or a"]),
    "no model_path": (ANGLES, [], None, ["no model given: model_path=RUN_DIR, model_path=CHECKPOINT.ckpt or"]),
    "a bare path": (ANGLES, ["{tmp}/run"], None, ["cannot read '{tmp}/run' as a setting: give key=value"]),
    "directory without checkpoints": (ANGLES, ["model_path={tmp}/run/checkpoints"], None,
                                      ["no checkpoint (.ckpt or <run>/checkpoints/step-*.ckpt) at {tmp}/run/",
                                       "checkpoints: give a .ckpt, a run directory"]),
    "config.json not JSON": (ANGLES, ["model_path={tmp}/hf"], (write('{"model_type": "gpt2",'), "hf/config.json"),
                             ["{tmp}/hf/config.json is not valid JSON (Expecting", "restore the model's config.json"]),
    "unsupported model type": (ANGLES, ["model_path={tmp}/hf"], (set_model_type, "hf/config.json"),
                               ["{tmp}/hf: model type bert is not supported",
                                "(supported: gpt2, normlab_rms_gpt2, gpt_neo"]),
    "corrupted checkpoint": (ANGLES, ["model_path={tmp}/" + STEP_2], (corrupt, STEP_2),
                             [f"{STEP_2} does not match the sha256 in its digest file", "give another checkpoint"]),
    "truncated checkpoint": (ANGLES, ["model_path={tmp}/" + STEP_2], (truncate, STEP_2),
                             [f"{STEP_2} holds 1,000 bytes, its digest file says", "truncated"]),
    "checkpoint without digest": (ANGLES, ["model_path={tmp}/" + STEP_2], (remove_digest, STEP_2),
                                  ["has no digest file step-0000002.ckpt.json", "or the run directory"]),
    "no intact checkpoint in a run": (ANGLES, ["model_path={tmp}/run"], (damage_every_checkpoint, "run/checkpoints"),
                                      ["no intact checkpoint in {tmp}/run/checkpoints: ", "(and 3 more damaged)",
                                       "train the run again"]),
    "seq_len beyond block_size": (ANGLES, ["model_path={tmp}/run", "seq_len=256"], None,
                                  ["seq_len=256 is beyond the context of {tmp}/run (128 tokens, model.block_size)",
                                   "give at most 128"]),
    "seq_len beyond n_positions": (ANGLES, ["model_path={tmp}/hf", "seq_len=128"], None,
                                   ["(64 tokens, n_positions in config.json): give at most 64"]),
    "seq_len not a number": (ANGLES, ["model_path={tmp}/run", "seq_len=long"], None,
                             ["seq_len=long: give a positive whole number, or null for the model's context"]),
    "zero tokens": (ANGLES, ["model_path={tmp}/run", "probe.tokens=0"], None,
                    ["probe.tokens=0: give a positive whole number, or null for the whole split"]),
    "fewer tokens than a sequence": (ANGLES, ["model_path={tmp}/run", "probe.tokens=100"], None,
                                     ["probe.tokens=100 is less than one sequence of 128 tokens", "smaller seq_len"]),
    "zero batch size": (ANGLES, ["model_path={tmp}/run", "probe.batch_size=0"], None,
                        ["probe.batch_size=0: give a positive whole number"]),
    "probe not prepared": (ANGLES, ["model_path={tmp}/run", "probe.dir={tmp}/nothing"], None,
                           ["data 'nothing' is not prepared", "normlab-prepare"]),
    "unknown probe set": (ANGLES, ["model_path={tmp}/run", "probe=books"], None,
                          ["unknown probe 'books': choose one of embedded, wikipedia (conf/probe/)"]),
    "a model with another vocabulary and no tokenizer": (
        ANGLES, ["model_path={tmp}/pythia"], None,
        ["{tmp}/pythia has no tokenizer files and a vocabulary of 50304 tokens, not GPT-2's 50257",
         "add the model's tokenizer files"]),
    "unknown dtype": (ANGLES, ["model_path={tmp}/run", "dtype=fp8"], None,
                      ["dtype=fp8: give one of float32, bfloat16, float16"]),
    "negative null directions": (ANGLES, ["model_path={tmp}/run", "probe.null_directions=-1"], None,
                                 ["probe.null_directions=-1: give a whole number of random directions (0: none)"]),
    "unknown device": (ANGLES, ["model_path={tmp}/run", "device=tpu"], None,
                       ["unknown device=tpu: give cpu, cuda or cuda:N"]),
    "a CUDA device torch does not see": (ANGLES, ["model_path={tmp}/run", "device=cuda:99"], None,
                                         ["device=cuda:99: torch sees ", "give device=cpu"]),
    "out a directory": (ANGLES, ["model_path={tmp}/run", "out={tmp}/hf"], None,
                        ["out={tmp}/hf is a directory: give a file name, e.g. out={tmp}/hf/angles.csv"]),
    "out with a sweep over model_path": (ANGLES, ["-m", "model_path={tmp}/run,{tmp}/hf", "out={tmp}/a.csv"], None,
                                         ["out= names one output, but model_path is swept (each job would write it)"]),
    "unknown option": (ANGLES, ["model_path={tmp}/run", "--verbose"], None, ["unrecognized arguments: --verbose"]),
    "unknown key": (ANGLES, ["model_path={tmp}/run", "tokens=100"], None,
                    ["Could not override 'tokens'. To append to your config use +tokens=100",
                     "(--help shows the config)"]),
    "angles.csv cut mid-row": (REPORT, ["runs={tmp}/run"], (cut_mid_row, "run/angles.csv"),
                               ["{tmp}/run/angles.csv, line ", "is cut short", "rerun the same normlab-train command",
                                "normlab-angles model_path={tmp}/run out={tmp}/run/angles.csv"]),
    "angles.csv row without a field": (REPORT, ["runs={tmp}/run"], (drop_a_field_of_line_3, "run/angles.csv"),
                                       ["{tmp}/run/angles.csv, line 3, has 27 fields, its header 28"]),
    "metrics.csv cut mid-row": (REPORT, ["runs=[{tmp}/run]"], (cut_mid_row, "run/metrics.csv"),
                                ["{tmp}/run/metrics.csv, line ", "is cut short",
                                 "rerun the same normlab-train command, which repairs it"]),
    "config.yaml not YAML": (REPORT, ["runs={tmp}/run"], (break_the_yaml, "run/config.yaml"),
                             ["{tmp}/run/config.yaml is not valid YAML (line ", "restore it"]),
    "config.yaml not a run config": (REPORT, ["runs={tmp}/run"], (write("- a list\n"), "run/config.yaml"),
                                     ["config.yaml is not a normlab run config (no model.name, norm.name, seed)"]),
    "report of a missing path": (REPORT, ["runs=[{tmp}/run,{tmp}/nothing]"], None, ["{tmp}/nothing does not exist"]),
    "norm class not on the path": (REPORT, ["runs={tmp}/run"], (name_a_class_off_the_path, "run/config.yaml"),
                                   ["{tmp}/run/config.yaml: its norm class my_norms.ScaleNorm cannot be imported",
                                    "put the folder that holds my_norms.py on PYTHONPATH"]),
    "reference no run has": (REPORT, ["runs={tmp}/run", "reference=rmsnorm"], None,
                             ["reference=rmsnorm: no run has that norm (the runs' norms: layernorm)"]),
    "pairs of a norm no run has": (REPORT, ["runs={tmp}/run", "pairs=[[layernorm,scalenorm]]"], None,
                                   ["pairs names scalenorm, which no run has"]),
    "report without runs": (REPORT, [], None, ["no runs given: runs=DIR or runs=[DIR,...]"]),
    "runs without brackets": (REPORT, ["runs={tmp}/run,{tmp}/hf"], None,
                              ["Ambiguous value for argument 'runs=", "To use it as a list, use key=[value1,value2]"]),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(case, prepared, inputs, tmp_path):
    tool, args, damage, fragments = CASES[case]
    shutil.copytree(inputs, tmp_path, dirs_exist_ok=True, ignore=SCHEDULED_ONLY)
    if damage:
        function, path = damage
        function(tmp_path / path)
    before = snapshot(tmp_path)
    outputs = [f"paths.output_dir={tmp_path}/checkpoints"] if tool == ANGLES else []  # where its CSVs would go

    result = run_cli(tool, *[a.format(tmp=tmp_path) for a in args], *outputs, cwd=tmp_path)

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
    result = run_cli(ANGLES, f"model_path={run}", f"probe.dir={prepared}", "probe.tokens=256", f"out={out}")

    assert result.returncode == 0, result.stderr[-3000:]
    (warning,) = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert "step-0000002.ckpt does not match the sha256" in warning and warning.endswith(": skipped")
    assert {r["step"] for r in read_csv(out)} == {0, 4, 6}
    assert "wrote" in result.stdout and "(3 checkpoints, 256 probe tokens)" in result.stdout


def test_a_sweep_over_checkpoints_writes_a_csv_for_each(prepared, inputs, tmp_path):
    shutil.copytree(inputs / "run", tmp_path / "run", ignore=SCHEDULED_ONLY)
    checkpoints = [f"run/checkpoints/step-000000{step}.ckpt" for step in (2, 4)]

    # relative paths: from the working directory, which the sweep leaves as it is
    result = run_cli(ANGLES, "-m", f"model_path={','.join(checkpoints)}", "paths.output_dir=out", "probe.tokens=256",
                     cwd=tmp_path)

    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]
    # <experiment>/<run>-<checkpoint>.csv: the run's folder here is the test's own
    assert sorted(p.name for p in (tmp_path / "out/angles").iterdir()) == ["multirun.yaml", tmp_path.name]
    assert sorted(p.name for p in (tmp_path / "out/angles" / tmp_path.name).iterdir()) == [  # and their records
        ".run-step-0000002.csv.normlab-angles.json", ".run-step-0000004.csv.normlab-angles.json",
        "run-step-0000002.csv", "run-step-0000004.csv"]
    for step in (2, 4):
        rows = read_csv(tmp_path / f"out/angles/{tmp_path.name}/run-step-000000{step}.csv")
        assert {(r["step"], r["source"]) for r in rows} == {(step, str(tmp_path / checkpoints[step // 2 - 1]))}


def test_runs_measured_into_one_csv_keep_every_row_with_what_was_measured(prepared, inputs, tmp_path):
    """Two runs of the same name (other experiments) and a second measurement of one of them, into one CSV: the
    rows of both are kept, each says which run, model, norm, seed, step and checkpoint it is, and the checkpoint
    measured again replaces its own rows only."""
    for experiment in ("a", "b"):
        shutil.copytree(inputs / "run", tmp_path / experiment / "run", ignore=SCHEDULED_ONLY)
    out = tmp_path / "all.csv"
    for model_path in ("a/run", "b/run", "a/run/checkpoints/step-0000004.ckpt"):
        result = run_cli(ANGLES, f"model_path={model_path}", "probe.tokens=256", f"out={out}", cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    rows = read_csv(out)
    per_checkpoint = {}
    for r in rows:
        per_checkpoint[(r["source"], r["step"])] = per_checkpoint.get((r["source"], r["step"]), 0) + 1
    assert sorted(per_checkpoint) == sorted((str(tmp_path / e / f"run/checkpoints/step-000000{s}.ckpt"), s)
                                            for e in ("a", "b") for s in (0, 2, 4, 6))
    assert len(set(per_checkpoint.values())) == 1  # each checkpoint's rows once
    config = OmegaConf.load(tmp_path / "a/run/config.yaml")
    assert {(r["run"], r["model"], r["norm"], r["seed"]) for r in rows} == {
        (config.run_name, config.model.name, config.norm.name, str(config.seed))}
