"""normlab-sample and normlab.interop.sample.generate on a tiny GPT written as a run directory (random weights: what is
tested is the decoding, not the text's quality): a seed's text is reproducible and another seed's differs, temperature
0 and top_k=1 are greedy, top_k draws only among the k most likely tokens, the prompt comes first, past the context a
token costs one window through the blocks and one position through the LM head and gives the tokens of whole-window
decoding, and bad input is one line, exit 2, nothing written."""

import json
from functools import partial

import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose_config, run_cli
from normlab.data.tokenizer import EOT, gpt2
from normlab.interop.sample import SampleError, generate, samples
from normlab.model.gpt import GPT, GPTConfig
from normlab.model.norms import RMSNorm
from normlab.training.rundir.checkpoints import write_checkpoint

SHAPE = dict(n_layer=2, n_head=2, n_embd=32, block_size=32)
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with scheduled checkpoints at steps 0 and 3 and a last.ckpt of step 5 torn after it was
    written (the newest intact one is step 3); the model's weights at step N are model_at(N)'s."""
    config = OmegaConf.to_container(compose_config("train", [f"model.{k}={v}" for k, v in SHAPE.items()]
                                                   + ["norm=rmsnorm"]), resolve=True)
    checkpoints = tmp_path_factory.mktemp("sample") / "run" / "checkpoints"
    for step in (0, 3, 5):
        weights = {f"model.{k}": v for k, v in model_at(step).state_dict().items()}
        write_checkpoint({"state_dict": weights, "hyper_parameters": {"config": config}, "global_step": step},
                         checkpoints / ("last.ckpt" if step == 5 else f"step-{step:07d}.ckpt"))
    (checkpoints / "last.ckpt").write_bytes((checkpoints / "last.ckpt").read_bytes()[:1000])
    return checkpoints.parent


def model_at(step: int) -> GPT:
    """GPT.init_weights(step), with logits 100x as large: GPT-2's initialisation gives near-uniform next-token
    probabilities, from which two models draw the same tokens for a seed; these draw different text."""
    model = GPT(GPTConfig(**SHAPE), partial(RMSNorm, bias=False))
    model.init_weights(step)
    with torch.no_grad():
        model.lm_head.weight.mul_(100)
    return model.eval()


def options(run, *overrides: str):
    return compose_config("sample", [f"model_path={run}", f"prompt={PROMPT}", "max_new_tokens=12", *overrides])


def texts(run, *overrides: str) -> list[str]:
    return [s["text"] for s in samples(options(run, *overrides))]


def test_a_seed_gives_the_same_text_and_another_seed_another(run):
    first = texts(run, "seed=7", "num_samples=2")
    assert first == texts(run, "seed=7", "num_samples=2")
    assert texts(run, "seed=8", "num_samples=2") != first
    assert first[0] != first[1]  # the samples of one command draw on from the same generator
    assert all(text.startswith(PROMPT) and len(text) > len(PROMPT) for text in first)


def test_temperature_zero_and_top_k_one_are_greedy_and_the_prompt_comes_first():
    model = model_at(3)
    prompt = gpt2().encode(PROMPT)
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(10):  # greedy decoding, written out here
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    greedy = tokens[0].tolist()
    assert greedy[: len(prompt)] == prompt
    assert generate(model, prompt, 10, temperature=0) == greedy
    for seed in (0, 1):
        drawn = generate(model, prompt, 10, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(seed))
        assert drawn == greedy


def test_past_the_context_a_token_runs_the_blocks_over_one_window_and_the_lm_head_over_one_position():
    """Issue 20: each token computed the logits of the whole window (block_size x 50,257), of which it draws from the
    last row only; on busy cores a token past the context took ~25x longer than now. The work per token is bounded."""
    model = model_at(3)
    block = model.config.block_size
    windows, head_rows = [], []
    model.wte.register_forward_hook(lambda module, args, out: windows.append(args[0].shape[1]))
    model.lm_head.register_forward_hook(lambda module, args, out: head_rows.append(args[0].shape[:-1].numel()))
    prompt = gpt2().encode(PROMPT)
    generate(model, prompt, 3 * block, temperature=0)
    assert windows == [min(len(prompt) + i, block) for i in range(3 * block)]
    assert head_rows == [1] * (3 * block)


def test_past_the_context_generate_gives_the_tokens_of_whole_window_decoding_written_out():
    model = model_at(3)
    block = model.config.block_size
    prompt = gpt2().encode(PROMPT)

    def decoded(temperature: float, generator: torch.Generator | None = None) -> list[int]:
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(3 * block):  # the last block_size tokens through the whole model, logits at every position
                logits = model(torch.tensor([tokens[-block:]]))[0, -1]
                if temperature == 0:
                    tokens.append(logits.argmax().item())
                else:
                    probs = torch.softmax(logits / temperature, -1)
                    tokens.append(torch.multinomial(probs, 1, generator=generator).item())
        return tokens

    greedy = decoded(0)
    assert generate(model, prompt, 3 * block, temperature=0) == greedy
    drawn = generate(model, prompt, 3 * block, temperature=100.0, generator=torch.Generator().manual_seed(0))
    assert drawn == decoded(100.0, torch.Generator().manual_seed(0)) != greedy


def test_top_k_draws_only_among_the_k_most_likely_tokens_and_a_stop_token_ends_the_sample():
    model = model_at(3)
    prompt = gpt2().encode(PROMPT)
    drawn = generate(model, prompt, 20, temperature=2.0, top_k=5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(torch.tensor([drawn[:-1]]))[0]
    for position in range(len(prompt) - 1, len(drawn) - 1):
        assert drawn[position + 1] in torch.topk(logits[position], 5).indices.tolist()
    assert drawn != generate(model, prompt, 20, temperature=0)  # it did sample, not decode greedily
    stopped = generate(model, prompt, 20, temperature=2.0, top_k=5, generator=torch.Generator().manual_seed(0),
                       stop_token=drawn[len(prompt) + 2])
    assert stopped == drawn[: len(prompt) + 3]


def test_only_ids_of_the_tokenizer_are_drawn_from_a_padded_vocabulary():
    model = GPT(GPTConfig(**SHAPE | {"vocab_size": 50304}), partial(RMSNorm, bias=False))
    model.init_weights(0)
    with torch.no_grad():
        model.lm_head.weight[EOT + 1:] = 10 * model.lm_head.weight.abs().max()  # the padding ids the most likely
    drawn = generate(model.eval(), [EOT], 8, temperature=0, vocab=gpt2().n_vocab)
    assert max(drawn) <= EOT


def test_normlab_sample_prints_and_writes_the_newest_intact_checkpoints_samples(run, tmp_path):
    result = run_cli("normlab-sample", f"model_path={run}", f"prompt={PROMPT}", "max_new_tokens=12", "seed=7",
                     "num_samples=2", f"out={tmp_path / 'samples.jsonl'}")
    assert result.returncode == 0, result.stderr[-2000:]
    (warning,) = result.stderr.strip().splitlines()
    assert warning.startswith(f"warning: {run}/checkpoints/last.ckpt ") and warning.endswith(": skipped")
    expected = texts(run / "checkpoints" / "step-0000003.ckpt", "seed=7", "num_samples=2")
    assert result.stdout == "".join(f"----- sample {i} (seed 7) -----\n{text}\n" for i, text in enumerate(expected))
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"sample": i, "seed": 7, "text": t} for i, t in enumerate(expected)]
    assert texts(run / "checkpoints" / "step-0000000.ckpt", "seed=7") != expected[:1]  # not step 0's model


@pytest.mark.parametrize("overrides, message", [
    (["model_path={tmp}/nothing"], "model_path={tmp}/nothing does not exist: give a .ckpt or a run directory"),
    (["model_path={tmp}"], "no checkpoint at {tmp} (neither a .ckpt nor a run directory with checkpoints/*.ckpt): "
                           "give a .ckpt or a run directory"),
    (["max_new_tokens=0"], "max_new_tokens=0: give a positive whole number"),
    (["temperature=-1"], "temperature=-1: give a number >= 0 (0: greedy)"),
    (["top_k=0"], "top_k=0: give a positive whole number, or null for the whole vocabulary"),
    (["num_samples=0"], "num_samples=0: give a positive whole number"),
    (["model_path={run}/checkpoints/last.ckpt"],
     "{run}/checkpoints/last.ckpt holds 1,000 bytes ... give another checkpoint of the run, or the run directory"),
    (["prompt=" + "fox " * 40],
     "the prompt is 40 tokens, longer than the model's context of 32: give a shorter prompt"),
    (["device=tpu"], "unknown device=tpu: give cpu, cuda or cuda:N"),
], ids=["missing path", "no checkpoint", "no new tokens", "negative temperature", "top_k 0", "no samples",
        "damaged checkpoint", "prompt beyond the context", "unknown device"])
def test_bad_options_are_refused_before_any_sampling(run, tmp_path, overrides, message):
    with pytest.raises(SampleError) as refused:
        samples(options(run, *[o.format(tmp=tmp_path, run=run) for o in overrides]))
    start, _, end = message.format(tmp=tmp_path, run=run).partition(" ... ")  # " ... ": any text between
    assert str(refused.value).startswith(start) and str(refused.value).endswith(end or start)
    assert "\n" not in str(refused.value)


def test_bad_input_on_the_command_line_is_one_line_exit_2_and_writes_nothing(run, tmp_path):
    out = tmp_path / "samples.txt"
    result = run_cli("normlab-sample", f"model_path={run}", "temperature=-1", f"out={out}")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.strip().splitlines() == [
        "normlab-sample: error: temperature=-1: give a number >= 0 (0: greedy)"]
    assert not out.exists()
    missing = run_cli("normlab-sample", f"out={out}")
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        "normlab-sample: error: no model given: model_path=RUN_DIR or model_path=CHECKPOINT.ckpt"]
