"""normlab-export: a normlab checkpoint as a Hugging Face model directory, with GPT-2's tokenizer files beside it.

A LayerNorm model (with or without bias; without, its biases are zeros) becomes transformers' GPT2LMHeadModel; a
model of any other norm (RMSNorm, DyT, a user's) becomes NormlabGPT2LMHeadModel, GPT-2 with the norm's own class,
whose module's source is saved with it as custom code (interop/norm_code.py). Each computes what the normlab model
computes: pre-norm blocks, learned positions, tanh GELU (gelu_new), the norm as trained, the LM head tied or not as
trained; nn.Linear weights become GPT-2's Conv1D (transposed). (Directories exported earlier as normlab_rms_gpt2 and
normlab_dyt_gpt2 still load: interop/hf_rmsnorm_gpt2.py, hf_dyt_gpt2.py.)
The tokenizer (vocab.json, merges.txt, tokenizer.json) is rebuilt offline from the tiktoken ranks file normlab
tokenizes with, so that it gives the ids the model was trained on. config.json carries `normlab`: the run, model,
norm, seed and step that were exported.
"""

import sys
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig, OmegaConf

from normlab.common import outputs
from normlab.common.errors import NormlabError
from normlab.data import tokenizer as gpt2
from normlab.interop import norm_code
from normlab.model import norms
from normlab.training import loader

if TYPE_CHECKING:
    import transformers  # only for the annotations: importing it takes seconds

COMMAND = "normlab-export"
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class ExportError(NormlabError):
    """A checkpoint that normlab-export cannot convert, or an output directory that it must not write."""


# -- the tokenizer


def last_merge(token: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """The two tokens whose merge makes `token`: byte-pair encoding of its bytes, stopped one merge short."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        i = min(range(len(parts) - 1), key=lambda j: ranks.get(parts[j] + parts[j + 1], len(ranks)))
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


@cache
def vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """GPT-2's vocab.json and merges.txt, recovered from the tiktoken ranks: a token's rank is its id, and its
    merge's priority (tiktoken merges the pair of lowest rank first); bytes are written as GPT-2's printable
    characters (transformers' bytes_to_unicode)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    encoding = gpt2.gpt2()
    tokens = [encoding.decode_single_token_bytes(rank) for rank in range(gpt2.EOT)]
    ranks = {token: rank for rank, token in enumerate(tokens)}
    byte_chars = bytes_to_unicode()
    as_text = lambda token: "".join(byte_chars[b] for b in token)  # noqa: E731
    vocab = {as_text(token): rank for rank, token in enumerate(tokens)} | {"<|endoftext|>": gpt2.EOT}
    merges = [tuple(as_text(part) for part in last_merge(token, ranks)) for token in tokens if len(token) > 1]
    return vocab, merges


def gpt2_tokenizer(model_max_length: int = 1024):
    """GPT-2's tokenizer for transformers (a GPT2TokenizerFast; <|endoftext|> is its bos, eos and unk token)."""
    from transformers import GPT2TokenizerFast

    vocab, merges = vocab_and_merges()
    return GPT2TokenizerFast(vocab=dict(vocab), merges=list(merges), model_max_length=model_max_length)


# -- the model


def hf_name(name: str) -> str:
    """The name of a normlab parameter in GPT2LMHeadModel."""
    return name if name.startswith("lm_head.") else "transformer." + name.replace("blocks.", "h.", 1)


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The normlab GPT's weights under GPT-2's names: Linear weights transposed to Conv1D's [in, out]; a bias-free
    LayerNorm's missing bias as zeros (torch's LayerNorm always has one)."""
    weights = {hf_name(name): tensor.t().contiguous() if name.endswith(CONV1D_WEIGHTS) else tensor
               for name, tensor in model.state_dict().items()}
    for name, module in model.named_modules():
        if norms.is_layernorm(module) and module.bias is None:
            weights[hf_name(f"{name}.bias")] = torch.zeros_like(module.weight)
    return weights


def site_norms(model: torch.nn.Module) -> dict:
    """A norm layer of each site kind (model.gpt.SITE_KINDS) of the normlab GPT `model`."""
    return {"attention": model.blocks[0].ln_1, "mlp": model.blocks[0].ln_2, "final": model.ln_f}


def hf_model(model: torch.nn.Module, metadata: dict, norm: dict | None = None):
    """The Hugging Face model that computes what the normlab GPT `model` computes: transformers' GPT2LMHeadModel for
    GPT-2's LayerNorm (of one eps at every site), else GPT-2 with the norm's own class (norm_code.py), built with
    every setting its layers were built with, per site kind: the run config's `norm` (norm.layer, and norm.sites
    where a site kind's differ; None: read from the modules). `metadata` goes into its config as `normlab`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c, sites = model.config, site_norms(model)
    settings = dict(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
                    n_head=c.n_head, activation_function="gelu_new", resid_pdrop=c.dropout, embd_pdrop=c.dropout,
                    attn_pdrop=c.dropout, bos_token_id=gpt2.EOT, eos_token_id=gpt2.EOT,
                    tie_word_embeddings=c.tie_embeddings, normlab=metadata)
    if all(norms.is_layernorm(layer) and layer.eps == model.ln_f.eps for layer in sites.values()):
        config, model_class = GPT2Config(layer_norm_epsilon=model.ln_f.eps, **settings), GPT2LMHeadModel
    else:  # GPT-2 with the norm's own class, its module carried as the directory's code
        layer = (norm or {}).get("layer")
        try:
            code = norm_code.model_module(type(model.ln_f))
            arguments = norm_code.norm_arguments(model.ln_f, layer)
            per_site = {kind: norm_code.norm_arguments(module, None if layer is None else
                                                       {**layer, **((norm or {}).get("sites") or {}).get(kind, {})})
                        for kind, module in sites.items()}
        except norm_code.NormCodeError as e:
            raise ExportError(str(e)) from None
        config = code.NormlabGPT2Config(norm_class=type(model.ln_f).__name__, norm_args=arguments,
                                        norm_site_args={k: v for k, v in per_site.items() if v != arguments},
                                        **settings)
        model_class = code.NormlabGPT2LMHeadModel
    return model_class.from_pretrained(None, config=config, state_dict=hf_state_dict(model))


def metadata(checkpoint: Path) -> dict:
    """What config.json says of the exported model: its run, model, norm, seed and step."""
    ckpt = loader.read_checkpoint(checkpoint)
    config = loader.saved_config(ckpt)
    return {"run": config["run_name"], "model": config["model"]["name"], "norm": config["norm"]["name"],
            "seed": config["seed"], "step": ckpt["global_step"], "checkpoint": checkpoint.name}


def hugging_face(
    checkpoint: Path, dtype: str = "float32"
) -> "tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerFast]":
    """The model of a normlab checkpoint as a transformers model (eval mode, in `dtype`) and GPT-2's tokenizer, in
    memory (nothing is written)."""
    checkpoint = Path(checkpoint)
    config = loader.saved_config(loader.read_checkpoint(checkpoint))
    if (config.get("branch") or {}).get("zero_mean_writers"):  # GPT-2's code would not centre its writes
        raise ExportError(f"{checkpoint} is a branch's zero-mean-writers control (branch.zero_mean_writers=true), "
                          "which Hugging Face's GPT-2 does not compute: it is for training comparisons, not export")
    model, norm = loader.load_model(checkpoint), config["norm"]
    converted = hf_model(model, metadata(checkpoint), norm).to(loader.DTYPES[dtype]).eval()
    return converted, gpt2_tokenizer(model.config.block_size)


# -- the command (conf/export.yaml)


def checked_checkpoint(path: Path) -> tuple[Path, int]:
    """`path` (a .ckpt, or a run directory: its newest intact checkpoint), verified against its digest file."""
    if path.is_dir() and (path / "config.json").is_file() and not (path / "checkpoints").is_dir():
        raise ExportError(f"{path} is a Hugging Face model directory already: give a .ckpt or a run directory")
    checkpoint, step, warnings = loader.chosen(path, ExportError)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return checkpoint, step


def default_out(checkpoint: Path, step: int) -> Path:
    """<run>/hf/step-NNNNNNN for a checkpoint of a run directory, else <folder>/<checkpoint's name>-hf."""
    checkpoint = checkpoint.absolute()
    if checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent / "hf" / f"step-{step:07d}"
    return checkpoint.with_name(f"{checkpoint.stem}-hf")


def checked_out(out: Path, overwrite: bool) -> None:
    """Before any work: `out` is new, empty, or an earlier export (its marker) that overwrite=true replaces."""
    try:
        outputs.check_folder(out, COMMAND, owned_in_run=("hf",), overwrite=overwrite)
    except outputs.OutputError as e:
        raise ExportError(str(e)) from None


def write(model, tokenizer, out: Path) -> None:
    """Model and tokenizer files into a staging folder beside `out`, swapped in once complete (outputs.py)."""
    try:
        with outputs.staged_folder(out, COMMAND) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)  # tokenizer.json and tokenizer_config.json
            tokenizer.backend_tokenizer.model.save(str(tmp))  # vocab.json and merges.txt, for GPT-2's slow tokenizer
    except outputs.OutputError as e:
        raise ExportError(str(e)) from None


def main(cfg: DictConfig) -> None:
    """normlab-export (normlab.cli.export): `model_path` (a .ckpt, or a run directory's newest intact checkpoint) as a
    Hugging Face model directory with GPT-2's tokenizer files, in `out` (conf/export.yaml)."""
    if OmegaConf.is_missing(cfg, "model_path") or not str(cfg.model_path).strip():
        raise ExportError("no model given: model_path=RUN_DIR or model_path=CHECKPOINT.ckpt")
    loader.check_dtype(cfg.dtype, ExportError)
    if not isinstance(cfg.overwrite, bool):
        raise ExportError(f"overwrite={cfg.overwrite}: give true or false")
    checkpoint, step = checked_checkpoint(Path(str(cfg.model_path)))
    out = Path(str(cfg.out)) if cfg.out is not None else default_out(checkpoint, step)
    checked_out(out, cfg.overwrite)
    from transformers.utils import logging

    logging.disable_progress_bar()  # of loading and writing the weights, which take no time here
    model, tokenizer = hugging_face(checkpoint, cfg.dtype)
    write(model, tokenizer, out)
    print(f"wrote {out} ({type(model).__name__}, {cfg.dtype}, {model.config.normlab['norm']}, step {step} of "
          f"{model.config.normlab['run']})")
