"""The built wheel: installed outside the checkout, every command runs with the configs it ships."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from normlab.common.paths import CHECKOUT, DATA_DIR

CONF = CHECKOUT / "conf"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """The wheel built from this checkout, installed (without its dependencies, which this environment has) into a
    folder of its own; the environment in which its commands find that copy of normlab first."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a copy: building writes build/ and *.egg-info beside the sources
    top_level_outputs = {".venv", ".git", "data", "checkpoints", "build"}
    shutil.copytree(CHECKOUT, source, ignore=lambda folder, names: [
        n for n in names if Path(folder) == CHECKOUT and n in top_level_outputs or n.endswith(".egg-info")])
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", root / "dist", source],
        capture_output=True, text=True,
    )
    assert build.returncode == 0, build.stderr
    assert "absent from the `packages` configuration" not in build.stdout + build.stderr  # every conf/ folder listed
    (wheel,) = (root / "dist").glob("normlab-*.whl")
    site = root / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", site, wheel],
                             capture_output=True, text=True)
    assert install.returncode == 0, install.stderr
    assert "warning" not in install.stderr.lower().replace("location 'file:///opt/pypi-more", ""), install.stderr
    env = {**os.environ, "PYTHONPATH": str(site), "PATH": f"{site / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("NORMLAB_ROOT", None)
    return site, env


def run(env: dict, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_wheel_ships_every_config_and_no_other_top_level_package(installed):
    site, _ = installed
    shipped = {p.relative_to(site / "normlab" / "conf") for p in (site / "normlab" / "conf").rglob("*.yaml")}
    package = CHECKOUT / "train" / "normlab"
    assert {p.relative_to(site / "normlab") for p in (site / "normlab").rglob("*.py")} == {
        p.relative_to(package) for p in package.rglob("*.py")}
    assert shipped == {p.relative_to(CONF) for p in CONF.rglob("*.yaml")}
    assert not (site / "train").exists() and not (site / "conf").exists()


def test_the_installed_commands_run_from_any_directory_on_the_project_in_the_working_directory(installed, tmp_path):
    site, env = installed
    work = tmp_path / "project"  # a user's project folder: data/ and checkpoints/ are found here
    shutil.copytree(DATA_DIR / "embedded", work / "data" / "embedded")
    shutil.copytree(DATA_DIR / "tokenizer", work / "data" / "tokenizer")
    where = run(env, work, sys.executable, "-c", "import normlab.common.paths as p; print(p.__file__, p.CONF_DIR)")
    assert where.stdout.split() == [str(site / "normlab" / "common" / "paths.py"), str(site / "normlab" / "conf")]

    described = run(env, work, "normlab-describe", "experiment=paper_1b")
    assert described.returncode == 0, described.stderr
    assert "1b (16 layers, d=2048" in described.stdout
    for command in ("normlab-train", "normlab-prepare", "normlab-angles", "normlab-ablate", "normlab-report",
                    "normlab-bench", "normlab-export", "normlab-sample", "normlab-eval", "normlab-convert"):
        helped = run(env, work, command, "--help")
        assert helped.returncode == 0, f"{command}: {helped.stderr}"

    trained = run(env, work, "normlab-train", "trainer.max_steps=2", "trainer.val_check_interval=1",
                  "logger=csv", "probe.tokens=512")
    assert trained.returncode == 0, trained.stderr
    (run_dir,) = (work / "checkpoints" / "default").iterdir()
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and (run_dir / "metrics.csv").is_file()
    # the default run's name holds its overrides (= and ,): quoted for Hydra's override parser
    sampled = run(env, work, "normlab-sample", f"model_path='{run_dir}'", "max_new_tokens=4")
    assert sampled.returncode == 0 and sampled.stdout.startswith("----- sample 0 (seed 0) -----"), sampled.stderr
    exported = run(env, work, "normlab-export", f"model_path='{run_dir}'")
    assert exported.returncode == 0 and (run_dir / "hf" / "step-0000002" / "config.json").is_file(), exported.stderr
    converted = run(env, work, "normlab-convert", f"model_path='{run_dir}'")  # reads the norm configs it ships
    assert converted.returncode == 0, converted.stderr
    assert (run_dir.with_name(f"{run_dir.name}-rms") / "checkpoints" / "step-0000002.ckpt.json").is_file()
