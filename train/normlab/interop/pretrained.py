"""A local Hugging Face model directory for the angle study and the ablation: its config.json checked against the
architectures the probe knows (probe.sites.LAYOUTS), its context, the columns that name it (what normlab-export
recorded of the run it exported, else the directory), its model in a dtype, and the probe set in its own tokens.
transformers is imported where it is used (it takes seconds); its errors read as one line naming what it read."""

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from normlab.data import tokenizer as gpt2
from normlab.probe.sites import LAYOUTS, norm_sites
from normlab.probe.table import AnalysisError
from normlab.training.loader import DTYPES


@contextmanager
def loading(what: str):
    """An error of transformers reading a model directory, as one line naming what it was reading."""
    try:
        yield
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for damaged files
        raise AnalysisError(f"cannot load {what} ({type(e).__name__}: {str(e).strip().splitlines()[0]})") from None


def model_config(path: Path):
    """(model type, transformers config) of the model directory `path`, of an architecture of LAYOUTS."""
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_bytes())
    except ValueError as e:
        raise AnalysisError(f"{config_file} is not valid JSON ({e}): restore the model's config.json") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in LAYOUTS or model_type == "normlab":
        raise AnalysisError(
            f"{path}: model type {model_type} is not supported "
            f"(supported: {', '.join(k for k in LAYOUTS if k != 'normlab')})"
        )
    from transformers import AutoConfig

    from normlab.interop import hf_dyt_gpt2, hf_rmsnorm_gpt2  # noqa: F401 (register normlab-export's model types)

    with loading(config_file):
        return model_type, AutoConfig.from_pretrained(path, trust_remote_code=exported_code(model_type))


def exported_code(model_type: str) -> bool:
    """Whether a directory of `model_type` is loaded with its own code: normlab-export's GPT-2 of any norm but
    LayerNorm carries the norm's module (interop/norm_code.py); every other type is transformers' or registered."""
    from normlab.interop.norm_code import MODEL_TYPE

    return model_type == MODEL_TYPE


def context(config) -> tuple[int, str]:
    """The context of a model (its number of positions) and where config.json gives it, for errors."""
    key = "n_positions" if hasattr(config, "n_positions") else "max_position_embeddings"
    return getattr(config, key), f"{key} in config.json"


def identity(path: Path, model_type: str, config) -> tuple[int, dict]:
    """The step and IDENTITY_COLUMNS of a model directory: those normlab-export recorded of the run it exported,
    else the directory's name, and a norm named once the model is loaded (with_norm)."""
    exported = getattr(config, "normlab", None)  # what normlab-export records of the run it exported
    exported = exported if isinstance(exported, dict) else {}
    return exported.get("step", 0), {
        "run": exported.get("run", path.resolve().name), "model": model_type, "norm": exported.get("norm", ""),
        "seed": exported.get("seed", ""), "source": str(path.resolve()),
    }


def with_norm(identity: dict, model: nn.Module, layout: str) -> dict:
    """`identity`, its norm named by the class of the model's norm layers where normlab-export recorded none
    (LayerNorm for GPT-2, LlamaRMSNorm for Llama...)."""
    return identity if identity["norm"] else {**identity, "norm": type(norm_sites(model, layout)[0].module).__name__}


def load_hugging_face(path: Path, dtype: str = "float32") -> nn.Module:
    """The causal LM of the model directory `path` in `dtype`, its raw weights (nothing folded)."""
    from transformers import AutoModelForCausalLM

    from normlab.interop import hf_dyt_gpt2, hf_rmsnorm_gpt2  # noqa: F401 (register normlab-export's model types)

    model_type = json.loads((path / "config.json").read_bytes()).get("model_type")
    with loading(f"the model in {path}"):  # raw weights: nothing folded
        return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype],
                                                    trust_remote_code=exported_code(model_type))


def hf_windows(path: Path, probe: torch.Tensor, vocab_size: int, seq_len: int) -> tuple[torch.Tensor, int]:
    """The probe for a Hugging Face model: its text re-tokenized with the model's own tokenizer when the
    directory has one, else the GPT-2 ids themselves (only for a vocabulary of GPT-2's size: any other is another
    tokenizer's, whose ids would be read as the wrong tokens). With the token id that separates its documents."""
    from transformers import AutoTokenizer

    tokenizer_files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((path / f).exists() for f in tokenizer_files):
        if vocab_size != gpt2.VOCAB_SIZE:
            raise AnalysisError(
                f"{path} has no tokenizer files and a vocabulary of {vocab_size} tokens, not GPT-2's "
                f"{gpt2.VOCAB_SIZE}: add the model's tokenizer files (tokenizer.json, ...) to the directory"
            )
        return probe[:, :seq_len], gpt2.EOT
    with loading(f"the tokenizer in {path}"):
        tok = AutoTokenizer.from_pretrained(path)
    documents = gpt2.gpt2().decode(probe.flatten().tolist()).split("<|endoftext|>")
    separator = tok.eos_token_id or 0
    ids = [t for doc in documents if doc for t in tok(doc)["input_ids"] + [separator]]  # a BOS, if any, after it
    n = min(len(ids) // seq_len, probe.numel() // seq_len)
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len), separator
