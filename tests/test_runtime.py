"""The speed settings (runtime: in conf/train.yaml) take effect, can be switched, and change no result."""

import os

import pytest
import torch
import torch.nn.functional as F

from conftest import compose_config
from normlab.common.errors import ConfigError
from normlab.probe.hooks import measure
from normlab.probe.sites import norm_sites
from normlab.training import runtime
from normlab.training.checks import check_train_config
from normlab.training.pipeline import build_module


def test_threads_default_to_the_cores_shared_by_the_processes_of_a_node():
    cores = len(os.sched_getaffinity(0))
    assert runtime.threads_per_process(None, 1) == cores
    assert runtime.threads_per_process(None, cores * 2) == 1
    assert runtime.threads_per_process(3, 1) == 3


def test_apply_sets_threads_allocator_precision_and_attention_backend():
    cfg = compose_config("train", ["runtime.threads=1", "runtime.attention=math", "runtime.matmul_precision=highest"])
    before = torch.get_num_threads()
    try:
        context = runtime.apply(cfg.runtime, processes_per_node=1)
        assert torch.get_num_threads() == 1 and torch.get_float32_matmul_precision() == "highest"
        q = torch.randn(1, 2, 8, 16)
        with context:
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert torch.allclose(out, F.scaled_dot_product_attention(q, q, q, is_causal=True), atol=1e-6)
    finally:
        torch.set_num_threads(before)
        torch.set_float32_matmul_precision("highest")
    assert runtime.keep_freed_memory()  # glibc accepted both settings
    with pytest.raises(ConfigError, match="runtime.attention=fastest: choose one of flash, efficient, cudnn, math"):
        runtime.apply(compose_config("train", ["runtime.attention=fastest"]).runtime, 1)


def test_compiled_blocks_train_like_eager_ones_and_keep_their_parameter_names():
    overrides = ["model.n_layer=1", "model.block_size=32", "model.vocab_size=256", "norm=rmsnorm"]
    eager = build_module(compose_config("train", overrides)).model
    compiled = build_module(compose_config("train", [*overrides, "runtime.compile=true"])).model
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # checkpoints interchangeable
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (eager, compiled):
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        losses.append((loss.detach(), model.wte.weight.grad))
    assert torch.allclose(losses[0][0], losses[1][0], atol=1e-5)
    assert torch.allclose(losses[0][1], losses[1][1], atol=1e-6)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):  # the angle probe on a compiled model
        stats = measure(lambda x, mask: compiled.hidden(x), norm_sites(compiled, "normlab"), 64, [(ids, None)])
    assert stats.records(0)


@pytest.mark.parametrize("override, message", [
    ("runtime.compile=whole", "runtime.compile=whole: give false, blocks (each transformer block), model (the whole "
                              "model, loss included; the blocks under strategy=fsdp) or true (blocks)"),
    ("runtime.compile_mode=fast", "runtime.compile_mode=fast: give one of default, reduce-overhead, max-autotune, "
                                  "max-autotune-no-cudagraphs (torch.compile's modes; reduce-overhead replays CUDA "
                                  "graphs)"),
    ("runtime.compile_mode=reduce-overhead", "runtime.compile_mode=reduce-overhead with runtime.compile=false "
                                             "compiles nothing: set runtime.compile=model (or blocks), or leave "
                                             "compile_mode at default"),
    ("runtime.compile=model runtime.compile_mode=max-autotune strategy=fsdp",
     "runtime.compile_mode=max-autotune replays CUDA graphs, which cannot hold the sharded strategy's gathers and "
     "reduce-scatters: use default or max-autotune-no-cudagraphs with strategy=fsdp"),
    ("runtime.loss_chunk=0", "runtime.loss_chunk=0: give a positive whole number"),
    ("runtime.head_rows_multiple=1.5", "runtime.head_rows_multiple=1.5: give a positive whole number"),
])
def test_a_bad_runtime_setting_is_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as refused:
        check_train_config(compose_config("train", override.split()))
    assert str(refused.value) == message
