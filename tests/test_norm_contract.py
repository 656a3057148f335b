"""A norm's contract, checked once before anything is written, by every command that builds a model: its yaml names
it (not with a built-in's name, unless it is the built-in, and no file of a user's takes a built-in's place), its
class imports (or one line says why: not on the path, a missing dependency, a syntax error at a line), it is built as
cls(width, **settings) with the width its first parameter, its output on a probe input has the input's shape and is
finite. Each failure is one line naming the class and its file, exit 2, and no run directory left behind."""

import textwrap
from pathlib import Path

import pytest

from conftest import run_cli

TINY = ["model=tiny", "data.batch_size=2", "data.val_tokens=1024", "logger=csv", "trainer.val_check_interval=2",
        "trainer.max_steps=8"]

MODULES = {
    "contract_norms.py": '''
        import torch
        from torch import nn


        class EpsFirst(nn.Module):  # the width would arrive as eps
            def __init__(self, eps=1e-5):
                super().__init__()
                self.eps = eps

            def forward(self, x):
                return x / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()


        class NoWidth(nn.Module):
            def forward(self, x):
                return x


        class Narrow(nn.Module):  # one column short
            def __init__(self, dim):
                super().__init__()
                self.weight = nn.Parameter(torch.ones(dim - 1))

            def forward(self, x):
                return x[..., 1:] * self.weight


        class Infinite(nn.Module):
            def __init__(self, dim, eps=0.0):
                super().__init__()
                self.eps = eps

            def forward(self, x):
                return x / (x - x + self.eps)
        ''',
    "needs_missing.py": "import torch\nimport not_installed_anywhere\n",
    "broken_syntax.py": "import torch\n\nclass Broken(torch.nn.Module)\n    pass\n",
}


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("contract")
    (folder / "mods").mkdir()
    for name, text in MODULES.items():
        (folder / "mods" / name).write_text(textwrap.dedent(text))
    (folder / "conf" / "norm").mkdir(parents=True)
    yamls = {"epsfirst": "contract_norms.EpsFirst", "nowidth": "contract_norms.NoWidth",
             "narrow": "contract_norms.Narrow", "infinite": "contract_norms.Infinite",
             "needsmissing": "needs_missing.Norm", "brokensyntax": "broken_syntax.Broken",
             "offpath": "not_on_the_path.Norm", "noclass": "contract_norms.NoSuchNorm"}
    for name, target in yamls.items():
        (folder / "conf" / "norm" / f"{name}.yaml").write_text(f"name: {name}\nlayer:\n  _target_: {target}\n"
                                                               "  _partial_: true\n")
    (folder / "conf" / "norm" / "noname.yaml").write_text("layer:\n  _target_: contract_norms.Narrow\n"
                                                          "  _partial_: true\n")
    (folder / "conf" / "norm" / "fakeln.yaml").write_text("name: layernorm\nlayer:\n  _target_: user_norms.ScaleNorm\n"
                                                          "  _partial_: true\n")
    return folder


CASES = {  # norm= -> the line (FILE: the module's path)
    "epsfirst": "norm 'epsfirst': contract_norms.EpsFirst (FILE): its first parameter, eps, has a default (1e-05), and "
                "normlab passes the width there: make the width the first parameter, __init__(self, dim, eps=...)",
    "nowidth": "norm 'nowidth': contract_norms.NoWidth (FILE): its constructor takes no width: make the width its "
               "first parameter, __init__(self, dim, ...)",
    "narrow": "norm 'narrow': contract_norms.Narrow (FILE): it returns (2, 3, 63) for an input of shape (2, 3, 64): "
              "a norm keeps its input's shape",
    "infinite": "norm 'infinite': contract_norms.Infinite (FILE): it returns values that are not finite on a random "
                "input",
    "needsmissing": "norm.layer._target_=needs_missing.Norm cannot be imported: needs_missing (MODS/needs_missing.py, "
                    "line 2) imports not_installed_anywhere, which is not installed here: install it",
    "brokensyntax": "norm.layer._target_=broken_syntax.Broken cannot be imported: MODS/broken_syntax.py, line 3: "
                    "expected ':': fix the syntax of broken_syntax",
    "offpath": "norm.layer._target_=not_on_the_path.Norm cannot be imported: no module not_on_the_path on the Python "
               "path: put the folder that holds not_on_the_path.py on PYTHONPATH, or check the spelling",
    "noclass": "norm.layer._target_=contract_norms.NoSuchNorm cannot be imported: contract_norms (FILE) has no "
               "NoSuchNorm: check the class's name",
    "noname": "the norm has no name (norm.name): give your norm's yaml a `name:`, the name its runs, figures and "
              "report go by (docs/norms.md)",
    "fakeln": "norm.name=layernorm is normlab's own norm (its class normlab.model.norms.LayerNorm), and this norm's "
              "class is user_norms.ScaleNorm: give your norm a name of its own",
}


def refused(result, command: str) -> str:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"{command}: error: ")
    return line.removeprefix(f"{command}: error: ")


@pytest.mark.parametrize("norm", CASES)
def test_a_norm_that_breaks_the_contract_is_refused_before_anything_is_written(user, tmp_path, norm):
    env = {"PYTHONPATH": f"{user / 'mods'}:{Path(__file__).parent}"}
    search = f"hydra.searchpath=[file://{user / 'conf'}]"
    expected = CASES[norm].replace("FILE", str(user / "mods" / "contract_norms.py")).replace("MODS", str(user / "mods"))
    train = run_cli("normlab-train", *TINY, f"run_dir={tmp_path / 'run'}", f"norm={norm}", search, env=env)
    assert refused(train, "normlab-train") == expected
    assert not (tmp_path / "run").exists()
    if norm in ("narrow", "epsfirst"):  # describe builds the model through the same check
        describe = run_cli("normlab-describe", "model=tiny", f"norm={norm}", search, env=env)
        assert refused(describe, "normlab-describe") == expected


def test_a_file_of_yours_with_a_built_in_norms_name_is_refused_not_shadowed(user, tmp_path):
    (user / "conf" / "norm" / "layernorm.yaml").write_text("name: layernorm\nlayer:\n  _target_: x.Y\n")
    try:
        result = run_cli("normlab-train", *TINY, f"run_dir={tmp_path / 'run'}", "norm=layernorm",
                         f"hydra.searchpath=[file://{user / 'conf'}]")
    finally:
        (user / "conf" / "norm" / "layernorm.yaml").unlink()
    assert refused(result, "normlab-train") == (
        f"your {user / 'conf' / 'norm' / 'layernorm.yaml'} has the name of normlab's own norm=layernorm, which Hydra "
        "takes in its place: rename your file (and the name in it)")
    assert not (tmp_path / "run").exists()
