"""One command line for every command: each a Hydra app whose --help and shell completion offer only choices that
compose, and answer without importing the heavy libraries (torch, Lightning, datasets, matplotlib...)."""

import os
import re
import subprocess
import sys

import pytest

from conftest import compose_config, run_cli

COMMANDS = ["normlab-train", "normlab-prepare", "normlab-describe", "normlab-angles", "normlab-ablate",
            "normlab-report", "normlab-bench", "normlab-export", "normlab-sample", "normlab-eval", "normlab-convert"]
HEAVY = ("torch", "lightning", "datasets", "matplotlib", "transformers", "wandb", "tiktoken", "lm_eval")


def completion(command: str, line: str) -> list[str]:
    result = run_cli(command, "-sc", "query=bash", env={"COMP_LINE": f"{command} {line}"})
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_help_and_completion_offer_every_option_that_composes_and_nothing_else():
    helped = run_cli("normlab-train", "--help")
    assert helped.returncode == 0, helped.stderr
    listing = helped.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    groups = dict(re.findall(r"^(\w+): (.+)$", listing, re.M))
    assert groups["data"] == "embedded, files, hub, openwebtext, wikipedia"  # not the shared data_module
    assert groups["experiment"] == ("cpu_study, cpu_study_tuning, demo, norm_arms, norm_arms_tuning, paper_160m, "
                                    "paper_1b, paper_410m, paper_70m")  # no paper_experiment
    for group, options in groups.items():
        options = options.split(", ")
        assert completion("normlab-train", f"{group}=") == [f"{group}={option}" for option in options]
        for option in options:
            compose_config("train", [f"{group}={option}"])
    assert not {"data_module", "paper_experiment"} & {w.rstrip("=/") for w in completion("normlab-train", "")}


@pytest.mark.parametrize("command, groups", [
    ("normlab-angles", {"paths", "probe"}), ("normlab-report", set()), ("normlab-bench", {"model", "paths"}),
    ("normlab-prepare", {"data", "paths"}), ("normlab-export", {"paths"}), ("normlab-sample", {"paths"}),
    ("normlab-eval", {"paths"}), ("normlab-convert", {"paths"}),
])
def test_help_and_completion_offer_only_the_groups_that_the_command_composes(command, groups):
    helped = run_cli(command, "--help")
    assert helped.returncode == 0, helped.stderr
    assert set(re.findall(r"^(\w+): ", helped.stdout.split("== Config ==")[0], re.M)) == groups
    assert ("== Configuration groups ==" in helped.stdout) == bool(groups)
    every_group = {"callbacks", "data", "experiment", "logger", "model", "norm", "optimizer", "paths", "probe",
                   "strategy", "trainer"}
    words = completion(command, "")
    assert {g for g in every_group if f"{g}=" in words} == groups
    assert "hydra" in words and ("paths." in words) == ("paths" in groups)  # the keys of a group only with it
    if command in ("normlab-angles", "normlab-export", "normlab-sample", "normlab-eval", "normlab-convert"):
        assert "model_path=" in words and completion(command, "mo") == ["model_path="]


def test_shared_parts_are_included_where_they_belong():
    paper = compose_config("train", ["experiment=paper_70m"])
    assert paper.data.name == "openwebtext" and paper.probe.split == "probe" and paper.global_batch_size == 64
    for corpus in ("embedded", "files", "hub", "openwebtext", "wikipedia"):
        assert compose_config("train", [f"data={corpus}"]).data._target_ == "normlab.data.datamodule.TokenDataModule"


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("answer", ["--help", "completion"])
def test_help_and_completion_import_nothing_heavy(command, answer):
    args, env = (["--help"], {}) if answer == "--help" else (["-sc", "query=bash"], {"COMP_LINE": f"{command} "})
    script = f"""
import sys
from importlib.metadata import entry_points
(entry,) = [e for e in entry_points(group="console_scripts") if e.name == {command!r}]
sys.argv = [{command!r}, *{args!r}]
try:
    entry.load()()
except SystemExit as e:
    assert not e.code, e.code
print("heavy:", *sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r})), file=sys.stderr)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()  # it answered
    assert result.stderr.strip().splitlines()[-1] == "heavy:"
