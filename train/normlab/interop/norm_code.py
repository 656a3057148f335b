"""The custom code of an exported model whose norm is not GPT-2's LayerNorm: GPT-2 (transformers' GPT2LMHeadModel)
with every `ln_1`, `ln_2` and `ln_f` built from the norm's own class, its module's source carried into the Hugging Face
directory (`modeling_normlab_gpt2.py`: that source, then the model's two classes). So
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` builds the model without normlab and without the
user's module, computing what normlab computed.

The norm's module is copied whole, so it must need nothing but torch and the standard library: any other import (of
normlab, numpy, another file of the user's) would fail where the model is loaded, and is refused here in one line.
An import inside `try: ... except ImportError:` is optional (transformers skips such imports too): normlab's own
norms import their fused CPU kernel that way, and fall back to torch's.
"""

import ast
import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from normlab.common.errors import NormlabError

MODULE = "modeling_normlab_gpt2"  # the file's name in the directory, and the module's in config.json's auto_map
MODEL_TYPE = "normlab_gpt2"

# The model's classes, after the norm module's source: a config naming the norm's class and its arguments, and GPT-2
# with that norm in each of its places
MODEL_CODE = '''

# -- normlab-export: GPT-2 with the norm above in place of LayerNorm (every other module is GPT-2's)

from transformers import GPT2Config as _GPT2Config
from transformers import GPT2LMHeadModel as _GPT2LMHeadModel


class NormlabGPT2Config(_GPT2Config):
    model_type = "normlab_gpt2"

    def __init__(self, norm_class: str = "", norm_args: dict | None = None, norm_site_args: dict | None = None,
                 **kwargs):
        # norm_site_args: the arguments of the norms before attention, before the MLP and at the end, where a site
        # kind's differ from norm_args
        self.norm_class, self.norm_args = norm_class, dict(norm_args or {})
        self.norm_site_args = dict(norm_site_args or {})
        super().__init__(**kwargs)


class NormlabGPT2LMHeadModel(_GPT2LMHeadModel):
    config_class = NormlabGPT2Config

    def __init__(self, config: NormlabGPT2Config):
        super().__init__(config)
        norm_class = globals()[config.norm_class]

        def norm(kind):
            return norm_class(config.n_embd, **config.norm_site_args.get(kind, config.norm_args))

        for block in self.transformer.h:
            block.ln_1, block.ln_2 = norm("attention"), norm("mlp")
        self.transformer.ln_f = norm("final")
        self.post_init()


NormlabGPT2Config.register_for_auto_class()
NormlabGPT2LMHeadModel.register_for_auto_class("AutoModelForCausalLM")
'''


class NormCodeError(NormlabError):
    """A norm whose module cannot go into an export as its custom code."""


def required_imports(tree: ast.AST) -> list[str]:
    """The top-level packages that a module imports outside `try` blocks (relative imports as '.name')."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Try):
            return  # optional imports, with a fallback: transformers skips them too
        if isinstance(node, ast.Import):
            found.extend(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append("." * node.level + (node.module or "").split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def norm_source(norm_class: type) -> str:
    """The source of the module that defines `norm_class`, once checked to need only torch and the standard
    library (NormCodeError, one line, otherwise)."""
    module = inspect.getmodule(norm_class)
    name = f"{norm_class.__module__}.{norm_class.__qualname__}"
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        raise NormCodeError(f"cannot export a model whose norm is {name}: the source of its module cannot be read "
                            "(define the class in a .py file)") from None
    if "." in norm_class.__qualname__:
        raise NormCodeError(f"cannot export a model whose norm is {name}: define the class at the top level of its "
                            "module")
    others = sorted({package for package in required_imports(ast.parse(source))
                     if package != "torch" and package not in sys.stdlib_module_names and package != "__future__"})
    if others:
        raise NormCodeError(f"cannot export a model whose norm is {name}: its module {module.__name__} imports "
                            f"{others[0]}, and the export carries that module into the model directory as its code, "
                            "which may import only torch and the standard library (an import inside try/except "
                            "ImportError is optional): move the norm into a module of its own")
    return source


def model_module(norm_class: type) -> ModuleType:
    """The module `modeling_normlab_gpt2` of an export whose norm is `norm_class`: written into a temporary folder and
    imported, so that save_pretrained copies it into the directory (as custom code, named in config.json's
    auto_map). The folder lives as long as the module."""
    folder = tempfile.TemporaryDirectory(prefix="normlab-export-")
    path = Path(folder.name) / f"{MODULE}.py"
    path.write_text(norm_source(norm_class) + MODEL_CODE)
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module  # save_pretrained finds the file to copy by the module's name: this export's
    spec.loader.exec_module(module)
    module.folder = folder
    return module


def norm_arguments(norm, given: dict | None) -> dict:
    """The arguments (besides the width) that build another `norm`: `given` (the run config's norm.layer), else
    read from the module by the names of its class's parameters (a bias parameter: whether it is there)."""
    if given is not None:
        return {k: v for k, v in given.items() if not k.startswith("_")}
    arguments = {}
    for parameter in list(inspect.signature(type(norm)).parameters.values())[1:]:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if not hasattr(norm, parameter.name) and parameter.default is parameter.empty:
            raise NormCodeError(f"cannot export a model whose norm is {type(norm).__name__}: its argument "
                                f"{parameter.name} is not stored on the module; export it from a checkpoint")
        value = getattr(norm, parameter.name, parameter.default)
        if isinstance(parameter.default, bool) and not isinstance(value, bool):  # bias=True builds a parameter
            value = value is not None
        arguments[parameter.name] = value
    return arguments
