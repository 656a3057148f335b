"""A controlled comparison: same seed => identical non-norm initial weights and identical batches."""

import itertools

import torch

from conftest import compose_config
from normlab.data.datamodule import ShuffledWindows
from normlab.training.pipeline import build_module


def modules(seed=0, model="tiny"):
    return {norm: build_module(compose_config("train", [f"norm={norm}", f"seed={seed}", f"model={model}"])).model
            for norm in ("layernorm", "rmsnorm")}


def test_same_seed_gives_identical_initial_weights_for_every_shared_parameter():
    models = modules()
    ln, rms = (dict(m.named_parameters()) for m in models.values())
    shared = ln.keys() & rms.keys()
    assert ln.keys() - shared == {f"blocks.{i}.ln_{j}.bias" for i in range(4) for j in (1, 2)} | {"ln_f.bias"}
    assert rms.keys() <= ln.keys()
    for name in shared:
        assert torch.equal(ln[name], rms[name]), name
    norm_weights = [n for n in shared if ".ln_" in n or n.startswith("ln_f")]
    assert len(norm_weights) == 2 * 4 + 1
    assert len(shared) - len(norm_weights) == len(list(models["rmsnorm"].parameters())) - len(norm_weights)


def test_same_seed_gives_identical_weights_at_paper_width():
    models = modules(model="70m")
    ln, rms = (dict(m.named_parameters()) for m in models.values())
    for name in ("wte.weight", "blocks.5.attn.c_attn.weight", "blocks.3.mlp.c_proj.weight", "lm_head.weight"):
        assert torch.equal(ln[name], rms[name]), name


def test_the_2x2_norm_variants_share_every_initial_weight_and_differ_in_centring_or_bias():
    """norm=layernorm,rmsnorm,layernorm_nobias,rmsnorm_bias: the same seed gives the same weights, norm parameters
    included; a variant with a bias has LayerNorm's parameter set, one without it RMSNorm's."""
    variants = {}
    for norm in ("layernorm", "rmsnorm", "layernorm_nobias", "rmsnorm_bias"):
        cfg = compose_config("train", [f"norm={norm}"])
        variants[(cfg.norm.centred, cfg.norm.bias)] = dict(build_module(cfg).model.named_parameters())
    assert set(variants) == {(True, True), (False, False), (True, False), (False, True)}
    for bias in (True, False):
        centred, uncentred = variants[(True, bias)], variants[(False, bias)]
        assert centred.keys() == uncentred.keys()
        assert any(name.endswith("ln_f.bias") for name in centred) == bias
        for name in centred:
            assert torch.equal(centred[name], uncentred[name]), name
    x = torch.randn(3, 64) + 2.0  # a component along 1: only the centred norms remove it
    with_bias = {c: build_module(compose_config("train", [f"norm={n}"])).model.ln_f
                 for c, n in ((True, "layernorm"), (False, "rmsnorm_bias"))}
    beta = torch.randn(64)
    for norm in with_bias.values():
        norm.bias.data.copy_(beta)
    ln, rms = with_bias[True], with_bias[False]
    torch.testing.assert_close(ln(x), rms(x - x.mean(-1, keepdim=True)))  # the same bias, after the same scaling


def test_another_seed_gives_other_weights():
    a, b = modules(seed=0)["layernorm"], modules(seed=1)["layernorm"]
    assert not torch.equal(a.wte.weight, b.wte.weight)
    assert not torch.equal(a.blocks[0].attn.c_attn.weight, b.blocks[0].attn.c_attn.weight)


def batches(norm, prepared, n, epoch=0):
    from hydra.utils import instantiate

    dm = instantiate(compose_config("train", [f"norm={norm}", "seed=0"]).data)
    dm.setup("fit")
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(epoch)
    return list(itertools.islice(loader, n))


def test_same_seed_gives_identical_batches_in_identical_order(prepared):
    for epoch in (0, 1):
        ln, rms = batches("layernorm", prepared, 20, epoch), batches("rmsnorm", prepared, 20, epoch)
        for (x1, y1), (x2, y2) in zip(ln, rms, strict=True):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
    first, second = batches("layernorm", prepared, 1, 0)[0][0], batches("layernorm", prepared, 1, 1)[0][0]
    assert not torch.equal(first, second)  # each epoch has its own order


def test_sampler_order_depends_on_seed_and_epoch_only():
    assert list(ShuffledWindows(50, 5, seed=7)) == list(ShuffledWindows(50, 5, seed=7))
    assert list(ShuffledWindows(50, 5, seed=7)) != list(ShuffledWindows(50, 5, seed=8))
    sampler = ShuffledWindows(50, 5, seed=7)
    sampler.set_epoch(1)
    assert sorted(sampler) == list(range(50)) and list(sampler) != list(ShuffledWindows(50, 5, seed=7))


def test_same_seed_gives_identical_dropout_masks():
    masks = {}
    for norm in ("layernorm", "rmsnorm"):
        cfg = compose_config("train", [f"norm={norm}", "model.dropout=0.5", "model.n_layer=2"])
        model = build_module(cfg).model.train()
        drawn = []
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.register_forward_hook(lambda m, inputs, output: drawn.append(output == 0))
        torch.manual_seed(cfg.seed)  # what seed_everything does before training
        model(torch.arange(64).view(2, 32))
        masks[norm] = drawn
    assert len(masks["layernorm"]) == 1 + 2 * 2  # embeddings, then attention and MLP of each block
    assert 0.4 < masks["layernorm"][0].float().mean() < 0.6
    for ln, rms in zip(*masks.values()):
        assert torch.equal(ln, rms)
