"""Where the norms of a model are: the norm sites of each supported architecture, in forward order, and the rows of
statistics each site gets."""

from dataclasses import dataclass

from torch import nn

from normlab.probe.table import POSITIONS, REFERENCES


@dataclass(frozen=True)
class NormSite:
    """A norm module to watch: `role` is attn_norm, mlp_norm or final_norm; final_norm has layer = n_layer."""
    layer: int
    role: str
    module: nn.Module


# Where the norms are, per architecture: (list of blocks, attention norm, MLP norm or None, final norm).
LAYOUTS = {
    "normlab": ("blocks", "ln_1", "ln_2", "ln_f"),
    "gpt2": ("transformer.h", "ln_1", "ln_2", "transformer.ln_f"),
    "normlab_rms_gpt2": ("transformer.h", "ln_1", "ln_2", "transformer.ln_f"),  # normlab-export's RMSNorm GPT-2
    "gpt_neo": ("transformer.h", "ln_1", "ln_2", "transformer.ln_f"),
    "gptj": ("transformer.h", "ln_1", None, "transformer.ln_f"),  # attention and MLP share one norm
    "gpt_neox": ("gpt_neox.layers", "input_layernorm", "post_attention_layernorm", "gpt_neox.final_layer_norm"),
    "llama": ("model.layers", "input_layernorm", "post_attention_layernorm", "model.norm"),
    "normlab_dyt_gpt2": ("transformer.h", "ln_1", "ln_2", "transformer.ln_f"),  # normlab-export's DyT GPT-2
    "normlab_gpt2": ("transformer.h", "ln_1", "ln_2", "transformer.ln_f"),  # normlab-export's GPT-2 of any other norm
}


def norm_sites(model: nn.Module, layout: str) -> list[NormSite]:
    """The norm modules of `model` (an architecture of LAYOUTS), in forward order."""
    blocks, attn_norm, mlp_norm, final_norm = LAYOUTS[layout]
    sites = []
    for i, block in enumerate(model.get_submodule(blocks)):
        sites.append(NormSite(i, "attn_norm", block.get_submodule(attn_norm)))
        if mlp_norm is not None:
            sites.append(NormSite(i, "mlp_norm", block.get_submodule(mlp_norm)))
    sites.append(NormSite(len(model.get_submodule(blocks)), "final_norm", model.get_submodule(final_norm)))
    return sites


def site_rows(site: NormSite, position: str) -> list[tuple[int, str, str, str]]:
    """The 7 rows of one norm at one position: its input and output against each reference, and its rotation."""
    rows = [(site.layer, f"{site.role}.{io}", ref, position) for io in ("input", "output") for ref in REFERENCES]
    return rows + [(site.layer, f"{site.role}.rotation", "input", position)]


def stat_rows(sites: list[NormSite]) -> list[tuple[int, str, str, str]]:
    return [row for s in sites for position in POSITIONS for row in site_rows(s, position)]
