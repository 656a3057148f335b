"""A controlled comparison of the norm arms (every norm of conf/norm/: LayerNorm and RMSNorm with and without bias,
DyT): same seed => identical non-norm initial weights, identical batches and dropout masks; the norms' own parameters
(DyT's alpha included) are not weight-decayed."""

import itertools

import torch

from conftest import NORM_CONFIGS, compose_config, norm_layer
from normlab.data.datamodule import ShuffledWindows
from normlab.model.norms import traits
from normlab.training.pipeline import build_module

ARMS = NORM_CONFIGS
NORM_SITES = [f"blocks.{i}.ln_{j}" for i in range(4) for j in (1, 2)] + ["ln_f"]  # of the tiny model


def of_a_norm(name: str) -> bool:
    return name.startswith(tuple(f"{site}." for site in NORM_SITES))


def modules(seed=0, model="tiny"):
    return {norm: build_module(compose_config("train", [f"norm={norm}", f"seed={seed}", f"model={model}"])).model
            for norm in ARMS}


def test_same_seed_gives_identical_initial_weights_for_every_non_norm_parameter():
    """Every arm has the same parameters outside its norms, equal to the last bit; the norms' own start as their
    class sets them, drawing nothing: gains 1, biases 0 (DyT's alpha its alpha_init)."""
    parameters = {norm: dict(model.named_parameters()) for norm, model in modules().items()}
    first = parameters[ARMS[0]]
    non_norm = {name for name in first if not of_a_norm(name)}
    assert len(non_norm) > 4 * 8 and all(any(of_a_norm(n) for n in p) for p in parameters.values())
    for norm, p in parameters.items():
        assert {name for name in p if not of_a_norm(name)} == non_norm, norm
        for name in non_norm:
            assert torch.equal(p[name], first[name]), (norm, name)
        for name, value in p.items():
            if of_a_norm(name) and name.endswith((".weight", ".bias")):
                assert torch.equal(value, torch.full_like(value, name.endswith(".weight"))), (norm, name)


def test_same_seed_gives_identical_weights_at_paper_width():
    parameters = [dict(m.named_parameters()) for m in modules(model="70m").values()]
    for name in ("wte.weight", "blocks.5.attn.c_attn.weight", "blocks.3.mlp.c_proj.weight", "lm_head.weight"):
        assert all(torch.equal(parameters[0][name], p[name]) for p in parameters[1:]), name


def test_the_2x2_norm_variants_share_every_initial_weight_and_differ_in_centring_or_bias():
    """The norms that say they are LayerNorm with or without its centring (norms.traits: centring_pair), with and
    without bias: the same seed gives the same weights, norm parameters included; a variant with a bias has
    LayerNorm's parameter set, one without it RMSNorm's."""
    variants, names = {}, {}
    for norm in (n for n in ARMS if traits(norm_layer(n)).centring_pair):
        model = build_module(compose_config("train", [f"norm={norm}"])).model
        variants[(traits(model.ln_f).centres, traits(model.ln_f).bias)] = dict(model.named_parameters())
        names[(traits(model.ln_f).centres, traits(model.ln_f).bias)] = norm
    assert set(variants) == {(True, True), (False, False), (True, False), (False, True)}
    for bias in (True, False):
        centred, uncentred = variants[(True, bias)], variants[(False, bias)]
        assert centred.keys() == uncentred.keys()
        assert any(name.endswith("ln_f.bias") for name in centred) == bias
        for name in centred:
            assert torch.equal(centred[name], uncentred[name]), name
    x = torch.randn(3, 64) + 2.0  # a component along 1: only the centred norms remove it
    with_bias = {c: build_module(compose_config("train", [f"norm={names[(c, True)]}"])).model.ln_f
                 for c in (True, False)}
    beta = torch.randn(64)
    for norm in with_bias.values():
        norm.bias.data.copy_(beta)
    ln, rms = with_bias[True], with_bias[False]
    torch.testing.assert_close(ln(x), rms(x - x.mean(-1, keepdim=True)))  # the same bias, after the same scaling


def test_every_arm_leaves_torchs_random_state_as_the_others_do():
    """Building a model draws from torch's global generator only in torch's own layers (nn.Linear, nn.Embedding: the
    same in every arm); the norms draw nothing, so what is drawn later (dropout masks) is the same for every arm."""
    states = []
    for norm in ARMS:
        torch.manual_seed(0)
        build_module(compose_config("train", [f"norm={norm}"]))
        states.append(torch.get_rng_state())
    assert all(torch.equal(states[0], state) for state in states[1:])


def test_dyt_takes_alpha_init_from_its_config():
    cfg = compose_config("train", ["norm=dyt", "norm.layer.alpha_init=0.2"])
    model = build_module(cfg).model
    alphas = [p for name, p in model.named_parameters() if name.endswith(".alpha")]
    assert len(alphas) == len(NORM_SITES) and all(p.tolist() == [torch.tensor(0.2).item()] for p in alphas)


def test_every_arm_decays_its_matrices_only():
    """AdamW's weight decay pulls a parameter towards 0: the gains, biases and DyT's alpha (a scale of the input,
    shape (1,)) are in the group without it."""
    for norm in ARMS:
        module = build_module(compose_config("train", [f"norm={norm}"]))
        decayed, not_decayed = module.configure_optimizers()["optimizer"].param_groups
        assert decayed["weight_decay"] > 0 and not_decayed["weight_decay"] == 0.0
        assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() < 2 for p in not_decayed["params"])
        norm_parameters = [p for name, p in module.model.named_parameters() if of_a_norm(name)]
        assert norm_parameters and {id(p) for p in norm_parameters} <= {id(p) for p in not_decayed["params"]}


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
        ln, *others = (batches(norm, prepared, 20, epoch) for norm in ARMS)
        for other in others:
            for (x1, y1), (x2, y2) in zip(ln, other, strict=True):
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
    for norm in ARMS:
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
    for ln, *others in zip(*masks.values(), strict=True):
        assert all(torch.equal(ln, other) for other in others)
