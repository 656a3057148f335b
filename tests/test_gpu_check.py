"""make gpu-check's script (slurm/gpu_check.sh) on the CPU: it refuses a machine without a GPU in one line, and
within its budget runs its stages in order, cutting the one that runs out of time and skipping the rest, its
progress in its log and nothing written outside its results folder."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "slurm" / "gpu_check.sh"
STAGES = ["preflight", "step-410m", "gains", "precision", "preflight-auto", "step-1b"]


def gpu_check(tmp_path, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path / "results"), **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path):
    result = gpu_check(tmp_path)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.strip() == "gpu_check.sh: no GPU that torch can use here: run it on a GPU node"
    assert not (tmp_path / "results").exists()


def test_a_stage_that_outruns_the_budget_is_cut_and_the_rest_skipped(tmp_path):
    """The first stage's normlab-bench stands in for one that outruns any budget (a sleep: how fast the real CPU
    preflight runs varies from 11 s to over a minute on these machines); the script's own Python runs as it is."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/bash\nif [[ "$*" == *normlab.bench* ]]; then exec sleep 1000; fi\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    result = gpu_check(tmp_path, GPU_CHECK_ON_CPU="1", GPU_CHECK_SECONDS="40", PYTHON=str(python))
    assert result.returncode == 0, result.stderr[-3000:]
    log = (tmp_path / "results" / "gpu-check.log").read_text()
    assert log == result.stdout  # the job's log and the terminal alike
    assert re.match(r"gpu-check on cpu, \w+, \d{4}-\d\d-\d\dT[\d:]+Z; budget 40 s\n", log)
    assert re.search(r"== preflight: normlab-bench sections=preflight \(at most (3\d|40) s\)\n", log)  # what is left
    cut = re.search(r"== preflight: exit (\d+) after (\d+) s in all", log)
    assert cut and int(cut[1]) in (124, 130) and 40 <= int(cut[2]) <= 60  # interrupted at the budget's end
    for stage in STAGES[1:]:
        assert f"== {stage}: skipped (the budget of 40 s is spent)" in log
    assert log.rstrip().endswith("results in " + str(tmp_path / "results"))
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["gpu-check.log"]  # no table of a cut stage
