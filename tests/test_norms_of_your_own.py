"""docs/norms.md run as written: ScaleNorm, a norm of a user's own, its module and its yaml taken from the page's code
blocks into a folder outside the package, through every command of the page's command block (normlab-describe,
-train, -angles, -ablate, -report, -export, -sample, -eval, -bench), with no edit to normlab; normlab-train's runs
shortened by the suite's FAST_TRAIN settings (reported with learning_check=false: they learned nothing yet). Then
the export loads with trust_remote_code where neither normlab nor the user's module can be imported, with normlab's
logits; a norm module that imports more than torch is refused in one line."""

import csv
import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import FAST_TRAIN, run_cli
from normlab.common.paths import CHECKOUT

PAGE = CHECKOUT / "docs" / "norms.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), re.S)


@pytest.fixture(scope="module")
def user(prepared, tmp_path_factory) -> Path:
    """A folder of the user's, outside the package: my_norms/scalenorm.py and my_conf/norm/scalenorm.yaml from the
    page, and the page's commands run in it, one by one (data/ and checkpoints/ under it: NORMLAB_ROOT)."""
    folder = tmp_path_factory.mktemp("user")
    (folder / "my_norms").mkdir()
    (folder / "my_norms" / "scalenorm.py").write_text(blocks("python")[0])
    (folder / "my_conf" / "norm").mkdir(parents=True)
    (folder / "my_conf" / "norm" / "scalenorm.yaml").write_text(blocks("yaml")[0])
    (folder / "data").mkdir()
    for prepared_here in ("embedded", "tokenizer"):  # what the user's normlab-prepare data=embedded left in data/
        (folder / "data" / prepared_here).symlink_to(prepared.parent / prepared_here)
    (script,) = blocks("bash")
    env = {"PYTHONPATH": str(folder / "my_norms"), "NORMLAB_ROOT": str(folder), "PWD": str(folder),
           "CONF": f"hydra.searchpath=[file://{folder}/my_conf]", "WANDB_MODE": "disabled"}
    for line in script.splitlines():
        words = shlex.split(line, comments=True)
        if not words or words[0] == "export" or "=" in words[0]:
            continue  # the variables, set above as the shell would
        args = [os.path.expandvars(w.replace("$PWD", str(folder)).replace("$CONF", env["CONF"])) for w in words[1:]]
        if words[0] == "normlab-train":  # a few steps, under the page's run names (no tag for FAST_TRAIN's settings)
            args += [*FAST_TRAIN, "logger=csv", "run_name=${model.name}-${norm.name}-seed${seed}"]
        if words[0] == "normlab-report":  # runs of a few steps learned nothing yet: compared all the same; the
            args += ["learning_check=false", "figures=false"]  # figures, not read here, are test_report's
        if words[0] == "normlab-ablate":  # the null at 4 random directions: it runs, as with the page's 20
            args += ["null_directions=4"]
        if words[0] == "normlab-bench":  # the page's timing at a size that takes seconds, not tens of them
            args += ["rows=256"]
        result = run_cli(words[0], *args, env=env, cwd=folder)
        assert result.returncode == 0, f"{line}\n{result.stderr[-3000:]}"
        (folder / f"{words[0]}.out").write_text(result.stdout)
    return folder


def test_every_command_of_the_page_takes_the_users_norm(user):
    (run,) = (user / "checkpoints" / "mine").glob("tiny-scalenorm-seed0*")
    describe = (user / "normlab-describe.out").read_text()
    assert "norm  " in describe and "scalenorm" in describe
    assert (run / "angles.csv").is_file() and (run / "ablation.csv").is_file()
    with open(run / "ablation.csv", newline="") as f:
        assert {(row["norm"], row["ablation"]) for row in csv.DictReader(f)} == {("scalenorm", "centred")}
    summary = (user / "checkpoints" / "mine" / "report" / "summary.md").read_text()
    assert "scalenorm − layernorm" in summary
    assert (run / "hf" / "step-0000006" / "modeling_normlab_gpt2.py").is_file()
    assert (run / "eval" / "results.csv").is_file()
    assert "scalenorm / layernorm" in (user / "normlab-bench.out").read_text()


def test_the_export_of_the_users_norm_loads_without_normlab_or_its_module(user, tmp_path):
    (run,) = (user / "checkpoints" / "mine").glob("tiny-scalenorm-seed0*")
    ids = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    script = ("import sys, torch; sys.modules['normlab'] = sys.modules['scalenorm'] = None\n"
              "from transformers import AutoModelForCausalLM\n"
              f"model = AutoModelForCausalLM.from_pretrained({str(run / 'hf' / 'step-0000006')!r}, "
              "trust_remote_code=True).eval()\n"
              "torch.save(model(torch.load('ids.pt')).logits.detach(), 'logits.pt')\n"
              "print(type(model.transformer.ln_f).__name__)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {"HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run([sys.executable, "-I", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ScaleNorm"]
    sys.path.insert(0, str(user / "my_norms"))
    try:
        from normlab.training.loader import load_model

        checkpoint = run / "checkpoints" / "step-0000006.ckpt"
        expected = load_model(checkpoint).eval()(ids).detach()
    finally:
        sys.path.remove(str(user / "my_norms"))
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=1e-5, atol=1e-4)


def test_a_norm_module_that_imports_more_than_torch_is_refused_in_one_line(user, tmp_path):
    module = tmp_path / "numpy_norm.py"
    module.write_text("import numpy\n" + blocks("python")[0].replace("class ScaleNorm", "class NumpyNorm"))
    sys.path.insert(0, str(tmp_path))
    try:
        from normlab.interop.export import ExportError, hf_model
        from normlab.model.gpt import GPT, GPTConfig

        norm = importlib.import_module("numpy_norm").NumpyNorm
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16), norm)
        with pytest.raises(ExportError, match=r"^cannot export a model whose norm is numpy_norm.NumpyNorm: its module "
                                              r"numpy_norm imports numpy, .* may import only torch"):
            hf_model(model, {"run": "r"})
    finally:
        sys.path.remove(str(tmp_path))
