"""The local engine on the device with the portable kernels (plain torch, the ones a GPU
runs): its greedy tokens are Hugging Face `generate`'s, its logprobs those of a plain
float32 forward, and weights a trainer on the same device hands it are the ones it
serves. The references run on the same device in float32."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from looprl.config import TrainConfig
from looprl.engines.local.engine import LocalEngine
from looprl.precision import TrainPrecision
from looprl.training.trainer import Trainer
from looprl.types import Generation, SamplingParams
from tests.gpu.conftest import tiny_llama
from tests.support.batches import toy_batch

pytestmark = pytest.mark.gpu

NEW_TOKENS = 24


def forward_logprobs(model, gen: Generation, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each output token from one unbatched float32 forward of
    `model` on its own device, on the CPU. (n,)"""
    device = next(model.parameters()).device
    ids = torch.tensor([gen.prompt_ids + gen.output_ids], device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(gen.prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1).cpu()
    return logp.gather(1, torch.tensor(gen.output_ids)[:, None])[:, 0]


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Hugging Face `generate`'s greedy continuation of one prompt (no padding)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
        )
    return out[0, len(prompt) :].tolist()


async def generate_all(engine, prompts, sampling) -> list[Generation]:
    return await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))


@pytest.fixture(scope="module")
def model(device):
    return tiny_llama(seed=0).to(device)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_portable_engine_matches_hugging_face(model, device, prompts, dtype):
    engine = LocalEngine(model, eos_token_ids=[], dtype=dtype, kernels="portable")
    assert next(engine._model.parameters()).device == device
    greedy = await generate_all(engine, prompts, SamplingParams(NEW_TOKENS, temperature=0))
    sampled = await generate_all(engine, prompts, SamplingParams(NEW_TOKENS, seed=7))
    await engine.stop()
    if dtype == "float32":  # bfloat16 may take another token where two nearly tie
        assert [g.output_ids for g in greedy] == [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    hf_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    for gen in greedy + sampled:
        assert len(gen.output_ids) == NEW_TOKENS
        got, want = torch.tensor(gen.logprobs), forward_logprobs(model, gen)
        if dtype == "float32":
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        else:  # as far from float32 as Hugging Face's bfloat16 forward is: the dtype's error
            hf_error = float((forward_logprobs(hf_bf16, gen) - want).abs().max())
            assert float((got - want).abs().max()) <= max(2 * hf_error, 0.05)


async def test_weights_from_a_trainer_on_the_device(model, device, prompts):
    """One bf16-autocast train step, its state dict into a float32 engine on the same
    device: the engine then serves the trained weights, tagged with the new version."""
    engine = LocalEngine(model, eos_token_ids=[], dtype="float32", kernels="portable")
    greedy = SamplingParams(NEW_TOKENS, temperature=0)
    before = await generate_all(engine, prompts[:3], greedy)
    policy = tiny_llama(seed=0)
    batch = toy_batch([(12, 4, 1.0, "a"), (9, 4, 0.0, "a"), (14, 6, 1.0, "b"), (8, 6, 0.0, "b")])
    trainer = Trainer(
        policy.to(device),
        TrainConfig(lr=1e-2),
        precision=TrainPrecision("bfloat16", True, "the gpu tests"),
    )
    trainer.train_step(batch)
    await engine.update_weights(trainer.state_dict_for_engine(), version=1)
    after = await generate_all(engine, prompts[:3], greedy)
    await engine.stop()
    assert next(engine._model.parameters()).device == device
    moved = 0.0
    for old, new in zip(before, after, strict=True):
        assert (old.versions, new.versions) == ([0] * NEW_TOKENS, [1] * NEW_TOKENS)
        want = forward_logprobs(trainer.model, new)
        torch.testing.assert_close(torch.tensor(new.logprobs), want, atol=1e-4, rtol=0)
        moved = max(moved, float((forward_logprobs(model, new) - want).abs().max()))
    assert moved > 1e-3, "the update changed no logprob: the engine kept the old weights"


async def test_decode_steps_from_cuda_graphs(model, device, prompts):
    """The engine replaying its decode steps from CUDA graphs (the CPU runs the same static
    step eagerly) samples what the plain decode samples, captures a graph per rounded
    shape only, and keeps them across a weight update, which it then serves."""
    graphs = "cuda" if device.type == "cuda" else "eager"
    plain = LocalEngine(model, eos_token_ids=[], dtype="float32", kernels="portable")
    replayed = LocalEngine(
        model, eos_token_ids=[], dtype="float32", kernels="portable", graphs=graphs
    )
    greedy = SamplingParams(NEW_TOKENS, temperature=0)
    want = await generate_all(plain, prompts, greedy)
    got = await generate_all(replayed, prompts, greedy)
    assert [g.output_ids for g in got] == [g.output_ids for g in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
        )
    captured = replayed._runner.graphs.captures
    if graphs == "cuda":  # 8 prompts of <= 17 + 24 tokens: rows 8 (then fewer), one width
        assert 1 <= captured <= 4
    other = tiny_llama(seed=1).to(device)
    await replayed.update_weights(other.state_dict(), version=1)
    await plain.update_weights(other.state_dict(), version=1)
    after = await generate_all(replayed, prompts, greedy)  # the same shapes as before
    assert replayed._runner.graphs.captures == captured  # weights written in place
    want_after = await generate_all(plain, prompts, greedy)
    assert [g.output_ids for g in after] == [g.output_ids for g in want_after]
    assert [g.output_ids for g in after] != [g.output_ids for g in got]
    # Every graph dropped (as when the cache grows), then captured again: into a fresh
    # pool (torch asserts on one whose graphs are all gone), not the eager fallback.
    replayed._runner.graphs.clear()
    again = await generate_all(replayed, prompts, greedy)
    assert [g.output_ids for g in again] == [g.output_ids for g in after]
    assert replayed._runner.graphs.failed is None
    if graphs == "cuda":
        assert replayed._runner.graphs.captures > captured
    await plain.stop()
    await replayed.stop()
