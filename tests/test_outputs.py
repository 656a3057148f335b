"""Nothing lost by a command that writes (common/outputs.py): an out= that is, lies inside or contains a run
directory or a prepared corpus is refused in one line before any work, with every byte of the user's files as it
was; overwrite=true replaces only an earlier output of the same command; a write killed midway leaves the old
output whole. The four reproductions of issue 20 run through the real commands on a run trained by normlab-train."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST_TRAIN, compose_config, run_cli, run_of
from normlab.common import outputs
from normlab.common.errors import DataError
from normlab.data.prepare import check_output
from normlab.interop import evaluate, sample
from normlab.interop.export import ExportError
from normlab.interop.export import main as export
from normlab.study import report


@pytest.fixture(scope="module")
def runs(sweep, tmp_path_factory) -> Path:
    """<root>/r: a finished tiny run (a copy of the session's LayerNorm run); <root>/other: a folder holding another
    user's file beside it."""
    root = tmp_path_factory.mktemp("outputs")
    shutil.copytree(run_of(sweep, "layernorm"), root / "r")
    return root


def tree(folder: Path) -> dict[str, str]:
    """Every file under `folder` by its path, with the sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(result: subprocess.CompletedProcess, command: str, *parts: str) -> None:
    """Exit 2 and one line on stderr, naming the command and containing each of `parts`."""
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"{command}: error: "), line
    for part in parts:
        assert part in line, line


# -- the four cases of the issue, through the real commands


def test_an_export_over_its_run_or_over_a_folder_of_runs_is_refused_and_every_byte_is_kept(runs):
    run, before = runs / "r", tree(runs)
    into_run = run_cli("normlab-export", f"model_path={run}", f"out={run}", "overwrite=true")
    refused(into_run, "normlab-export", f"out={run} is a run directory")
    over_runs = run_cli("normlab-export", f"model_path={run}", f"out={runs}", "overwrite=true")
    refused(over_runs, "normlab-export", f"out={runs} contains a run directory, {run}")
    assert tree(runs) == before


def test_sample_into_a_runs_metrics_csv_is_refused_before_any_token_is_generated(runs, monkeypatch):
    metrics = runs / "r" / "metrics.csv"
    before = metrics.read_bytes()
    result = run_cli("normlab-sample", f"model_path={runs / 'r'}", "max_new_tokens=3", f"out={metrics}")
    refused(result, "normlab-sample", f"out={metrics} lies inside a run directory, {runs / 'r'}")
    assert metrics.read_bytes() == before
    # checked before the model is even loaded
    monkeypatch.setattr(sample.loader, "load_model",
                        lambda *a, **k: pytest.fail("loaded the model before checking out="))
    with pytest.raises(sample.SampleError, match="lies inside a run directory"):
        sample.samples(compose_config("sample", [f"model_path={runs / 'r'}", f"out={metrics}"]))


def test_ablate_over_a_runs_config_yaml_is_refused_and_the_run_still_resumes(runs):
    run = runs / "r"
    before = tree(run)
    result = run_cli("normlab-ablate", f"model_path={run}", f"out={run / 'config.yaml'}", "probe.tokens=1024")
    refused(result, "normlab-ablate", "lies inside a run directory", "it writes only ablation.csv")
    assert tree(run) == before
    again = run_cli("normlab-train", f"run_dir={run}", *FAST_TRAIN)  # the finished run is recognised, not refused
    assert again.returncode == 0, again.stderr[-2000:]
    assert "holds checkpoints of another config" not in again.stderr


# -- each command's own outputs


def test_sample_replaces_only_its_own_earlier_output_and_only_with_overwrite(runs, tmp_path):
    out, notes = tmp_path / "samples.jsonl", tmp_path / "notes.txt"
    settings = [f"model_path={runs / 'r'}", "max_new_tokens=2"]
    sample.main(compose_config("sample", [*settings, f"out={out}"]))
    first = out.read_bytes()
    with pytest.raises(sample.SampleError, match=f"out={out} exists .an earlier output of normlab-sample.: give "
                                                 "overwrite=true"):
        sample.main(compose_config("sample", [*settings, f"out={out}", "seed=1"]))
    assert out.read_bytes() == first
    sample.main(compose_config("sample", [*settings, f"out={out}", "seed=1", "overwrite=true"]))
    assert out.read_bytes() != first and json.loads(out.read_text().splitlines()[0])["seed"] == 1
    notes.write_text("my notes\n")
    with pytest.raises(sample.SampleError, match="exists and was not written by normlab-sample"):
        sample.main(compose_config("sample", [*settings, f"out={notes}", "overwrite=true"]))
    assert notes.read_text() == "my notes\n"


def test_export_replaces_only_its_own_export_holding_nothing_else(runs, tmp_path):
    out, settings = tmp_path / "hf", [f"model_path={runs / 'r'}"]
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=f"out={out} is not empty and was not written by normlab-export"):
        export(compose_config("export", [*settings, f"out={out}", "overwrite=true"]))
    assert tree(out) == {"notes.txt": hashlib.sha256(b"mine").hexdigest()}
    (out / "notes.txt").unlink()
    export(compose_config("export", [*settings, f"out={out}"]))
    marker = json.loads((out / ".normlab-export.json").read_text())
    assert marker["command"] == "normlab-export" and "config.json" in marker["files"]
    first = tree(out)
    with pytest.raises(ExportError, match=f"out={out} exists .an earlier output of normlab-export.: give "
                                          "overwrite=true"):
        export(compose_config("export", [*settings, f"out={out}"]))
    export(compose_config("export", [*settings, f"out={out}", "overwrite=true", "dtype=bfloat16"]))
    assert tree(out).keys() == first.keys() and tree(out) != first
    (out / "README.md").write_text("model card")  # a file the user added to the export
    with pytest.raises(ExportError, match=f"out={out} holds README.md, which normlab-export did not write"):
        export(compose_config("export", [*settings, f"out={out}", "overwrite=true"]))
    assert (out / "README.md").read_text() == "model card"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging folder left


def test_the_report_rewrites_its_own_report_and_nothing_else(runs, tmp_path):
    out = tmp_path / "report"
    report.report([runs / "r"], out)
    written = tree(out)
    assert "summary.md" in written and ".normlab-report.json" in written
    report.report([runs / "r"], out)  # its own earlier report: rewritten without a flag
    assert tree(out).keys() == written.keys()
    (out / "my-analysis.ipynb").write_text("{}")
    with pytest.raises(outputs.OutputError, match="holds my-analysis.ipynb, which normlab-report did not write"):
        report.report([runs / "r"], out)
    with pytest.raises(outputs.OutputError, match=f"out={runs} contains a run directory"):
        report.report([runs / "r"], runs)
    assert (out / "my-analysis.ipynb").read_text() == "{}"


@pytest.mark.parametrize("where, message", [
    ("run", "out={run} is a run directory"),
    ("run/checkpoints", "out={run}/checkpoints lies inside a run directory"),
    ("run/eval/results.csv", "out={run}/eval/results.csv is a file: give a folder"),
    ("run/eval", "out={run}/eval/results.csv exists and was not written by normlab-eval"),
])
def test_eval_writes_in_a_run_only_its_own_files_in_eval(tmp_path, where, message):
    run = tmp_path / "run"  # a run directory (its run_id) whose eval/ holds a table of the user's
    (run / "eval").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / "run_id").write_text("abc\n")
    (run / "eval" / "results.csv").write_text("my,own,table\n")
    before = tree(tmp_path)
    with pytest.raises(evaluate.EvalError) as error:
        evaluate.check_out(tmp_path / where)
    assert str(error.value).startswith(message.format(run=run)) and "\n" not in str(error.value)
    assert tree(tmp_path) == before


def test_angles_and_bench_refuse_files_they_did_not_write_before_any_work(runs, tmp_path):
    run, before = runs / "r", tree(runs)
    angles = run_cli("normlab-angles", f"model_path={run}", f"out={run / 'angles.csv'}")
    refused(angles, "normlab-angles", "lies inside a run directory")
    foreign = tmp_path / "table.csv"
    foreign.write_text("a,b\n1,2\n")
    other = run_cli("normlab-angles", f"model_path={run}", f"out={foreign}")
    refused(other, "normlab-angles", f"out={foreign} exists and was not written by normlab-angles")
    bench = run_cli("normlab-bench", "sections=[norms]", f"out={run / 'metrics.csv'}")
    refused(bench, "normlab-bench", "lies inside a run directory")
    assert tree(runs) == before and foreign.read_text() == "a,b\n1,2\n"


def test_prepare_refuses_a_corpus_inside_a_run_or_another_corpus(runs, prepared):
    with pytest.raises(DataError, match=f"lies inside a run directory, {runs / 'r'}"):
        check_output(runs / "r" / "corpus")
    with pytest.raises(DataError, match=f"lies inside a prepared corpus, {prepared}"):
        check_output(prepared / "nested")


def test_describe_writes_nothing(tmp_path):
    result = run_cli("normlab-describe", "model=tiny", cwd=tmp_path, env={"NORMLAB_ROOT": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


# -- atomic writes


WRITER = """
import sys, time
from pathlib import Path
from normlab.common import outputs
out = Path(sys.argv[1])
with outputs.staged_folder(out, "normlab-report") as new:
    (new / "summary.md").write_text("new report")
    print("writing", flush=True)
    time.sleep(60)
"""


def test_a_folder_write_killed_midway_leaves_the_old_output_whole_and_is_put_right(tmp_path):
    out = tmp_path / "report"
    with outputs.staged_folder(out, "normlab-report") as new:
        (new / "summary.md").write_text("old report")
    before = tree(out)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(out)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline() == "writing\n"
    writer.send_signal(signal.SIGKILL)
    assert writer.wait() == -signal.SIGKILL
    assert tree(out) == before  # the old output, whole
    (staging,) = tmp_path.glob(".report.staging-*")
    outputs.check_folder(out, "normlab-report")  # the next run removes what the killed one left
    assert not staging.exists() and tree(out) == before
    # killed between its two renames: the old output renamed aside, the new one not yet in place
    out.rename(tmp_path / f".report.old-{outputs.HOST}-{writer.pid}")
    outputs.check_folder(out, "normlab-report")
    assert tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["report"]


def test_a_failed_folder_write_leaves_the_old_output_and_no_staging_folder(tmp_path):
    out = tmp_path / "report"
    with outputs.staged_folder(out, "normlab-report") as new:
        (new / "summary.md").write_text("old report")
    with pytest.raises(RuntimeError), outputs.staged_folder(out, "normlab-report") as new:
        (new / "summary.md").write_text("half")
        raise RuntimeError("a figure failed")
    assert (out / "summary.md").read_text() == "old report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]


def test_a_file_write_replaces_the_file_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "bench.md"
    outputs.write_file(path, "old")
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(outputs.OutputError, match=f"cannot write {path} .No space left on device."):
        outputs.write_file(path, "new")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["bench.md"]


def test_a_new_only_staging_leaves_a_folder_that_appeared_meanwhile_as_it_was(tmp_path):
    """staging(replace=False), as normlab-convert writes a new run directory: a folder that another process created at
    out while the output was written is neither moved aside nor deleted; the staging folder is removed."""
    out = tmp_path / "run-rms"
    with pytest.raises(OSError):
        with outputs.staging(out, "normlab-convert", replace=False) as folder:
            (folder / "config.yaml").write_text("ours\n")
            out.mkdir()
            (out / "theirs.txt").write_text("theirs\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-rms"]
    assert [p.name for p in out.iterdir()] == ["theirs.txt"] and (out / "theirs.txt").read_text() == "theirs\n"
