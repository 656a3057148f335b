"""The chunked head and loss (model/head_loss.py) compute what the eager head and F.cross_entropy compute: the same loss
and every gradient within 1e-6 in float32, padded or not, in chunks that do or do not divide the tokens; never saving
B x T x vocab logits for the backward pass; and a model compiled whole trains like the eager one."""

import pytest
import torch
import torch.nn.functional as F

from conftest import compose_config
from normlab.model.head_loss import head_loss
from normlab.training.pipeline import build_module

TINY = ["model=tiny", "model.block_size=32"]
SEVENTY_SHAPED = ["model=70m", "model.n_layer=2", "model.block_size=32"]  # the 70m's width, heads and vocabulary


def batch(vocab: int, rows: int = 3, length: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (rows, length + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def reference_loss(model, x, y) -> torch.Tensor:
    """The loss as it was computed before the chunked head: the whole logits, in float32."""
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def loss_and_grads(model, loss_fn, x, y) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, x, y)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("shape", [TINY, SEVENTY_SHAPED], ids=["tiny", "70m-shaped"])
@pytest.mark.parametrize("chunk, multiple", [(8192, 128), (7, 128), (32, 1), (50, 64)])
def test_loss_and_every_gradient_equal_the_eager_reference_in_float32(shape, chunk, multiple):
    cfg = compose_config("train", [*shape, "norm=layernorm", f"runtime.loss_chunk={chunk}",
                                   f"runtime.head_rows_multiple={multiple}"])
    model = build_module(cfg).model
    assert model.loss_chunk == chunk and model.head_rows_multiple == multiple
    x, y = batch(cfg.model.vocab_size)
    chunked, chunked_grads = loss_and_grads(model, lambda m, x, y: m(x, targets=y), x, y)
    reference, reference_grads = loss_and_grads(model, reference_loss, x, y)
    assert abs(chunked.item() - reference.item()) <= 1e-6
    for name, grad in reference_grads.items():
        assert torch.allclose(chunked_grads[name], grad, rtol=0, atol=1e-6), name
    with torch.no_grad():  # validation: the loss alone
        assert abs(model(x, targets=y).item() - reference.item()) <= 1e-6


def test_the_padded_head_keeps_parameters_checkpoints_and_logits():
    plain = build_module(compose_config("train", [*TINY, "runtime.head_rows_multiple=1"])).model
    padded = build_module(compose_config("train", [*TINY, "runtime.head_rows_multiple=128"])).model
    assert plain.config.vocab_size % 128  # the tiny model's vocabulary is GPT-2's, 50257: it is padded
    assert plain.num_params() == padded.num_params()
    assert {k: v.shape for k, v in plain.state_dict().items()} == {k: v.shape for k, v in padded.state_dict().items()}
    x, y = batch(plain.config.vocab_size)
    assert torch.equal(plain(x), padded(x))  # the logits of normlab-sample, -eval and export: the plain head's
    assert abs(plain(x, targets=y).item() - padded(x, targets=y).item()) <= 1e-6


def test_no_tensor_of_batch_by_vocabulary_is_kept_for_the_backward_pass():
    model = build_module(compose_config("train", TINY)).model
    x, y = batch(model.config.vocab_size)
    logits_size = x.numel() * model.config.vocab_size
    for loss_fn, keeps_logits in ((lambda: model(x, targets=y), False), (lambda: reference_loss(model, x, y), True)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            loss_fn()
        assert (max(saved) >= logits_size) == keeps_logits  # the reference keeps them: the check can tell


def test_under_bf16_autocast_the_loss_follows_the_eager_head_within_bf16_rounding():
    model = build_module(compose_config("train", TINY)).model
    x, y = batch(model.config.vocab_size)
    with torch.autocast("cpu", torch.bfloat16):
        chunked, chunked_grads = loss_and_grads(model, lambda m, x, y: m(x, targets=y), x, y)
        reference, reference_grads = loss_and_grads(model, reference_loss, x, y)
    assert abs(chunked.item() - reference.item()) < 1e-2
    head = "lm_head.weight"
    assert F.cosine_similarity(chunked_grads[head].flatten(), reference_grads[head].flatten(), dim=0) > 0.999


def test_head_loss_takes_any_leading_shape_and_a_vocabulary_below_one_padded_row():
    h, w = torch.randn(2, 5, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    y = torch.randint(0, 11, (2, 5))
    loss = head_loss(h, w, y, chunk=3, rows_multiple=16)
    loss.backward()
    assert h.grad.shape == h.shape and w.grad.shape == w.shape


def test_a_model_compiled_whole_trains_like_the_eager_one_for_20_steps():
    overrides = ["model.n_layer=2", "model.block_size=32", "model.vocab_size=300", "norm=rmsnorm",
                 "runtime.loss_chunk=40"]
    losses = {}
    for scope, mode in (("false", "default"), ("model", "default"), ("model", "reduce-overhead")):
        module = build_module(compose_config("train", [*overrides, f"runtime.compile={scope}",
                                                       f"runtime.compile_mode={mode}"]))
        optimizer = module.configure_optimizers()["optimizer"]
        losses[scope, mode] = []
        for step in range(20):
            loss = module.loss(batch(300, rows=2))  # one batch, learned by heart
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[scope, mode].append(loss.item())
    eager = losses["false", "default"]
    assert eager[-1] < eager[0] - 0.1  # it learned: the comparison means something
    assert losses["model", "default"] == pytest.approx(eager, abs=2e-4)
    assert losses["model", "reduce-overhead"] == pytest.approx(eager, abs=2e-4)  # CUDA graphs: on a CPU, no more
