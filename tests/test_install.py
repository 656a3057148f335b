"""The install commands the README and docs/configuration.md print, resolved against pyproject.toml by pip's
resolver (PyPI and this machine's local index, as `make install` reaches them), and the pins of the libraries that
read the hub: what the tests ran on."""

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DEFAULT_TORCH = re.search(r"^TORCH \?= (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
PINNED = ("datasets", "huggingface_hub")


def dependencies() -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, PYPROJECT["project"]["dependencies"])}


def install_commands() -> list[str]:
    """Every `make install ...` and `pip install ...` the README and docs/configuration.md print."""
    found = []
    for page in ("README.md", "docs/configuration.md"):
        text = re.sub(r"\s*\n\s*", " ", (ROOT / page).read_text())  # a command may wrap across lines
        found += re.findall(r"make install(?: TORCH=\S+)?|pip install (?:-e )?\"?\.(?:\[[\w,]+\])?\"?", text)
    return sorted({command.rstrip("`),.") for command in found})


def torch_of(command: str) -> str:
    match = re.search(r"TORCH=(\S+)", command)
    return match.group(1) if match else DEFAULT_TORCH


def resolve(*requirements: str) -> subprocess.CompletedProcess:
    """pip's resolution of a fresh install of `requirements` in the checkout (nothing installed), its report on
    stdout."""
    return subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", "-", *requirements], cwd=ROOT, capture_output=True, text=True, timeout=900)


def resolved_versions(result: subprocess.CompletedProcess) -> dict[str, str]:
    report = json.loads(result.stdout)
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}


def test_the_docs_print_make_install_for_a_cuda_node_and_no_torch_the_pins_refuse():
    commands = install_commands()
    assert "make install" in commands and any("TORCH=" in c for c in commands), commands
    torch = dependencies()["torch"]
    for command in commands:
        version = Requirement(torch_of(command)).specifier
        pinned = [str(s)[2:] for s in version if s.operator == "=="]
        assert pinned and all(torch.specifier.contains(v, prereleases=True) for v in pinned), command


def test_every_install_command_resolves_against_pyproject():
    """`make install` with the Makefile's torch is what installed this suite's environment: pip's check of it. Any
    other TORCH= is resolved afresh with the test extra (the largest set of requirements any command installs), and
    so is a torch that the pins refuse, which must fail."""
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert metadata.version("torch").split("+")[0] == DEFAULT_TORCH.split("==")[1]
    others = sorted({torch_of(c) for c in install_commands()} - {DEFAULT_TORCH})
    for torch in others:
        result = resolve("-e", ".[test]", torch)
        assert result.returncode == 0, f"{torch}: {result.stderr[-2000:]}"
        versions = resolved_versions(result)
        assert versions["torch"].split("+")[0] == torch.split("==")[1]
        for name in PINNED:
            assert dependencies()[canonicalize_name(name)].specifier.contains(versions[canonicalize_name(name)])
    refused = resolve("-e", ".", "torch==2.5.1")  # the README's former CUDA line
    assert refused.returncode != 0 and "torch" in refused.stderr


def documented_pins() -> dict[str, tuple[str, str]]:
    """docs/configuration.md's table of tested versions: package -> (pinned, tested)."""
    text = (ROOT / "docs/configuration.md").read_text()
    section = text[text.index("### Tested versions"):]
    rows = re.findall(r"^\| ([\w-]+) \| ([^|]+) \| ([^|]+) \|$", section, re.M)
    return {canonicalize_name(name): (pinned.strip(), tested.strip()) for name, pinned, tested in rows
            if name != "package"}


@pytest.mark.parametrize("name", PINNED)
def test_what_reads_the_hub_is_pinned_to_what_was_tested(name):
    """pyproject.toml's pin is bounded above and is the documented one; this environment, a fresh install of it,
    holds a version inside it: the one the data tests ran on, as the table says."""
    requirement = dependencies()[canonicalize_name(name)]
    assert any(s.operator == "<" for s in requirement.specifier), f"{name} has no upper bound: {requirement}"
    pinned, tested = documented_pins()[canonicalize_name(name)]
    assert str(requirement.specifier) == ",".join(sorted(pinned.split(",")))
    installed = metadata.version(name)
    assert requirement.specifier.contains(installed), f"{name} {installed} lies outside {requirement.specifier}"
    assert installed == tested, f"the tests run on {name} {installed}; docs/configuration.md says {tested}"
