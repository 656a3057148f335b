"""Nothing lost by a command that writes (common/outputs.py): an out= that is, lies inside or contains a run
directory or a prepared corpus is refused in one line before any work, with every byte of the user's files as it
was; overwrite=true replaces only an earlier output of the same command; a write killed midway leaves the old
output whole. The four reproductions of issue 20 run through the real commands on a run trained by normlab-train."""

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    with pytest.raises(outputs.OutputError, match=f"out={out} appeared while normlab-convert worked: left as it was"):
        with outputs.staging(out, "normlab-convert") as folder:
            (folder / "config.yaml").write_text("ours\n")
            out.mkdir()
            (out / "theirs.txt").write_text("theirs\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-rms"]
    assert [p.name for p in out.iterdir()] == ["theirs.txt"] and (out / "theirs.txt").read_text() == "theirs\n"


# -- the check and the write are one act (issue 30): what appears or changes at out= while a command works is kept


def test_a_file_written_into_an_export_while_it_is_replaced_is_kept(runs, tmp_path, monkeypatch):
    """EXP, an earlier export, gets a README.md while `normlab-export out=EXP overwrite=true` works: refused at the
    swap, EXP as it was with the README."""
    out, settings = tmp_path / "exp", [f"model_path={runs / 'r'}", f"out={tmp_path / 'exp'}"]
    export(compose_config("export", settings))
    real = export.__globals__["hugging_face"]

    def meanwhile(*args, **kwargs):
        (out / "README.md").write_text("model card")  # after the check, before the swap
        return real(*args, **kwargs)

    before = tree(out)
    monkeypatch.setitem(export.__globals__, "hugging_face", meanwhile)
    with pytest.raises(ExportError, match=f"out={out} holds README.md, which normlab-export did not write .or has "
                                          "changed., while normlab-export worked: left as it was"):
        export(compose_config("export", [*settings, "overwrite=true", "dtype=bfloat16"]))
    assert tree(out) == {**before, "README.md": hashlib.sha256(b"model card").hexdigest()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # no staging or old folder left


def test_a_notebook_written_into_a_report_while_it_is_rewritten_is_kept(runs, tmp_path, monkeypatch):
    out = tmp_path / "report"
    report.report([runs / "r"], out)
    before = tree(out)
    real = report.draw_group

    def meanwhile(*args, **kwargs):
        (out / "analysis.ipynb").write_text("{}")
        return real(*args, **kwargs)

    monkeypatch.setattr(report, "draw_group", meanwhile)
    with pytest.raises(outputs.OutputError, match="holds analysis.ipynb, which normlab-report did not write"):
        report.report([runs / "r"], out)
    assert tree(out) == {**before, "analysis.ipynb": hashlib.sha256(b"{}").hexdigest()}


def test_a_file_written_at_a_new_sample_path_while_sampling_is_kept(runs, tmp_path, monkeypatch):
    out = tmp_path / "new.txt"  # absent when normlab-sample checks it
    real = sample.generate

    def meanwhile(*args, **kwargs):
        out.write_text("the user's own text\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(sample, "generate", meanwhile)
    with pytest.raises(sample.SampleError, match=f"out={out} was written by something else while normlab-sample "
                                                 "worked: left as it was"):
        sample.main(compose_config("sample", [f"model_path={runs / 'r'}", "max_new_tokens=3", f"out={out}"]))
    assert out.read_text() == "the user's own text\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.txt"]


def test_a_file_the_command_wrote_and_the_user_changed_is_no_longer_its_own(runs, tmp_path):
    """A fine-tuned model save_pretrained into the export folder (same file names), a sample file edited by hand:
    overwrite=true refuses both, byte for byte kept; the untouched outputs are still replaced."""
    from transformers import AutoModelForCausalLM

    out, settings = tmp_path / "exp", [f"model_path={runs / 'r'}", f"out={tmp_path / 'exp'}", "overwrite=true"]
    export(compose_config("export", settings))
    tuned = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        tuned.lm_head.weight.add_(0.01)
    tuned.save_pretrained(out)
    before = tree(out)
    with pytest.raises(ExportError, match=f"out={out} holds model.safetensors, which has changed since "
                                          "normlab-export wrote it"):
        export(compose_config("export", settings))
    assert tree(out) == before
    text, args = tmp_path / "s.txt", [f"model_path={runs / 'r'}", "max_new_tokens=2", f"out={tmp_path / 's.txt'}"]
    sample.main(compose_config("sample", args))
    sample.main(compose_config("sample", [*args, "overwrite=true", "seed=3"]))  # its own, untouched: replaced
    text.write_text(text.read_text() + "my note\n")
    edited = text.read_bytes()
    with pytest.raises(sample.SampleError, match="exists and was changed since normlab-sample wrote it"):
        sample.main(compose_config("sample", [*args, "overwrite=true"]))
    assert text.read_bytes() == edited


def test_a_copied_output_is_still_the_commands_own_and_records_from_before_them_still_count(runs, tmp_path):
    """A copy keeps the bytes, not the times: still the command's own (by sha256). An export written before records
    were kept (its marker lists names) counts a file as its own while it is no newer than the marker."""
    out = tmp_path / "exp"
    export(compose_config("export", [f"model_path={runs / 'r'}", f"out={out}"]))
    copy = Path(shutil.copytree(out, tmp_path / "copy"))  # new modification times
    outputs.check_folder(copy, "normlab-export", overwrite=True)
    marker = copy / ".normlab-export.json"
    marker.write_text(json.dumps({"command": "normlab-export", "files": sorted(json.loads(marker.read_text())[
        "files"])}))  # the marker of an earlier normlab: names only
    outputs.check_folder(copy, "normlab-export", overwrite=True)
    os.utime(copy / "config.json", ns=(marker.stat().st_mtime_ns + 10**9,) * 2)  # changed after the marker
    with pytest.raises(outputs.OutputError, match="holds config.json, which has changed since normlab-export wrote"):
        outputs.check_folder(copy, "normlab-export", overwrite=True)


def test_an_export_is_readable_like_the_rest_of_the_folder(runs, tmp_path):
    out = tmp_path / "exp"
    export(compose_config("export", [f"model_path={runs / 'r'}", f"out={out}"]))
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [out, *out.rglob("*")]}
    assert modes.pop("exp") == 0o777 & ~mask and set(modes.values()) == {0o666 & ~mask}, modes
    assert "model.safetensors" in modes


@pytest.mark.parametrize("command, args", [
    ("normlab-export", ["-m", "model_path={run},{run}/checkpoints/step-0000004.ckpt", "out={tmp}/exp",
                        "overwrite=true"]),
    ("normlab-sample", ["-m", "model_path={run}", "seed=1,2", "out={tmp}/s.txt", "overwrite=true"]),
    ("normlab-convert", ["-m", "model_path={run},{run}/checkpoints/step-0000004.ckpt", "out={tmp}/rms"]),
])
def test_one_out_for_a_sweep_of_several_jobs_is_refused_up_front(runs, tmp_path, command, args):
    args = [a.format(run=runs / "r", tmp=tmp_path) for a in args]
    swept = "seed" if command == "normlab-sample" else "model_path"
    result = run_cli(command, *args, f"paths.output_dir={tmp_path / 'sweeps'}", cwd=tmp_path)
    refused(result, command, f"out= names one output, but {swept} is swept (each job would write it)")
    assert list(tmp_path.iterdir()) == []


def test_a_new_output_never_replaces_what_appears_in_the_instant_before_it_goes_into_place(tmp_path, monkeypatch):
    """The last instant: between the swap's own check and its rename. The rename itself refuses (RENAME_NOREPLACE;
    a hard link for a file), so a file or folder planted right before it stays, and the output is not written."""
    real = outputs.rename_new

    def planted(source, target):
        target.mkdir() if source.is_dir() else target.write_text("theirs\n")
        (target / "theirs.txt").write_text("theirs\n") if source.is_dir() else None
        return real(source, target)

    monkeypatch.setattr(outputs, "rename_new", planted)
    with pytest.raises(outputs.OutputError, match="appeared while normlab-report worked: left as it was"):
        with outputs.staged_folder(tmp_path / "report", "normlab-report") as new:
            (new / "summary.md").write_text("ours")
    assert tree(tmp_path / "report") == {"theirs.txt": hashlib.sha256(b"theirs\n").hexdigest()}
    with pytest.raises(outputs.OutputError, match="appeared while normlab-bench worked: left as it was"):
        outputs.write_output(tmp_path / "bench.md", "normlab-bench ours\n", "normlab-bench", lambda line: True)
    assert (tmp_path / "bench.md").read_text() == "theirs\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".") and "tmp" in p.name) == []
