"""LocalEngine against real model files: logprob parity, batching, stops, versions, limits.

The reference for every logprob is a plain teacher-forced forward of the same weights on
prompt + output, without padding, cache or batching.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from looprl.config import EngineConfig
from looprl.engines.base import EngineError, EngineUnavailable
from looprl.engines.local.engine import LocalEngine
from looprl.models import load_model, load_tokenizer
from looprl.precision import EnginePrecision, layer_shape, probe
from looprl.types import Generation, SamplingParams

pytestmark = pytest.mark.kernels  # run again on a forced AVX2 CPU by make test

QUESTIONS = [
    "What is 2 + 3?",
    "Name a color.",
    "Write one sentence about the sea and the wind over it.",
    "Hi",
    "Count from one to five, please, separated by commas.",
    "What is the capital of France?",
    "7 * 8 = ?",
    "Tell me a short joke about a cat who learned to program in Python.",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Chat-templated prompts of different lengths (so batches are padded)."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
        )
        for q in QUESTIONS
    ]


def random_model(model_dir, seed: int) -> LlamaForCausalLM:
    """The tiny fixture model's architecture, untied and initialized at a larger scale.

    With tied embeddings at the default scale, a random model's greedy output repeats the
    last prompt token, which would make every greedy comparison pass trivially.
    """
    config = LlamaConfig.from_pretrained(
        model_dir, tie_word_embeddings=False, initializer_range=0.1
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir) -> LlamaForCausalLM:
    return random_model(tiny_model_dir, seed=0)


@pytest.fixture(scope="module")
def other_tiny_model(tiny_model_dir) -> LlamaForCausalLM:
    """Different weights for the same architecture, to load with update_weights."""
    return random_model(tiny_model_dir, seed=1)


@pytest.fixture(scope="module")
def smol_model(smol_model_dir) -> LlamaForCausalLM:
    return load_model(smol_model_dir)


FORWARDS = {  # id -> (engine.impl, engine.weight_layout, engine.kernels, graphs)
    "fused-packed": ("fused", "packed", "cpu", "off"),
    "fused-plain": ("fused", "plain", "cpu", "off"),
    "fused-portable": ("fused", "plain", "portable", "off"),
    # the static decode CUDA graphs replay (graphs.py), run eagerly: the GPU's step here
    "fused-static": ("fused", "plain", "portable", "eager"),
    "hf": ("hf", "plain", "cpu", "off"),
}


def forward_engine(model, forward: str, **options) -> LocalEngine:
    """A float32 engine on `model` with the forward FORWARDS names `forward`."""
    impl, layout, kernels, graphs = FORWARDS[forward]
    return LocalEngine(
        model,
        dtype="float32",
        impl=impl,
        weight_layout=layout,
        kernels=kernels,
        graphs=graphs,
        **options,
    )


@pytest.fixture(params=FORWARDS)
async def tiny_engine(request, tiny_model, tokenizer):
    """Every forward, in float32: the fused one with the cpu kernels, oneDNN-packed and
    plain weights (the path a CPU takes where a dtype does not pack), with the portable
    kernels (what a GPU runs), and Hugging Face's. Every test on this fixture holds for
    each."""
    engine = forward_engine(
        tiny_model, request.param, eos_token_ids=[tokenizer.eos_token_id], decode=tokenizer.decode
    )
    yield engine
    await engine.stop()


def teacher_forced_logprobs(
    model: LlamaForCausalLM, gen: Generation, temperature: float = 1.0
) -> torch.Tensor:
    """log_softmax(logits / T) of each output token, from one unbatched forward."""
    ids = torch.tensor([gen.prompt_ids + gen.output_ids])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(gen.prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(gen.output_ids)[:, None])[:, 0]


async def generate_all(engine, prompts, sampling) -> list[Generation]:
    return await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))


# the real 135M model, ~40 s a case on a 2-core AVX2 CPU
@pytest.mark.slow
@pytest.mark.parametrize(
    ("temperature", "layout", "kernels"),
    [
        (1.0, "packed", "cpu"),
        (1.0, "plain", "cpu"),
        (0.7, "packed", "cpu"),
        (1.0, "plain", "portable"),
    ],
)
async def test_logprobs_match_teacher_forcing_real_model(
    smol_model, tokenizer, prompts, temperature, layout, kernels
):
    engine = LocalEngine(
        smol_model,
        eos_token_ids=[tokenizer.eos_token_id],
        dtype="float32",
        weight_layout=layout,
        kernels=kernels,
    )
    sampling = SamplingParams(max_new_tokens=10, temperature=temperature)
    gens = await generate_all(engine, prompts[:4], sampling)
    await engine.stop()
    for gen in gens:
        expected = teacher_forced_logprobs(smol_model, gen, temperature)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-3, rtol=0)


async def test_event_loop_stays_responsive_while_decoding(smol_model, prompts):
    """The engine yields to the loop after every step: a coroutine sharing it runs between
    any two decode steps. Counted in steps, not seconds, so a loaded machine cannot fail
    it (the runner's decode is wrapped to mark each step)."""
    engine = LocalEngine(smol_model, eos_token_ids=[], dtype="float32")
    events: list[str] = []
    decode = engine._runner.decode

    def marked_decode(tokens):
        events.append("step")
        return decode(tokens)

    engine._runner.decode = marked_decode

    async def ticker() -> None:
        while True:
            events.append("tick")
            await asyncio.sleep(0)

    ticking = asyncio.create_task(ticker())
    steps = 32
    await engine.generate(prompts[0], SamplingParams(max_new_tokens=steps))
    ticking.cancel()
    await engine.stop()
    decoded = [i for i, event in enumerate(events) if event == "step"]
    assert len(decoded) == steps - 1  # the first token comes from the prefill
    # A loop blocked for the whole generation would tick before and after it only.
    assert all("tick" in events[a:b] for a, b in zip(decoded, decoded[1:], strict=False))


async def test_logprobs_match_teacher_forcing_with_top_k_top_p(tiny_engine, tiny_model, prompts):
    """Truncated sampling reports logprobs under the renormalized truncated distribution."""
    t, k, p = 0.8, 20, 0.5
    sampling = SamplingParams(max_new_tokens=8, temperature=t, top_k=k, top_p=p, top_logprobs=3)
    gens = await generate_all(tiny_engine, prompts, sampling)
    for gen in gens:
        ids = torch.tensor([gen.prompt_ids + gen.output_ids])
        with torch.inference_mode():
            logits = tiny_model(input_ids=ids).logits[0, len(gen.prompt_ids) - 1 : -1]
        for step, token in enumerate(gen.output_ids):
            sorted_logits, order = (logits[step] / t).sort(descending=True)
            probs = sorted_logits[:k].softmax(-1)
            keep = int(((probs.cumsum(-1) - probs) < p).sum())
            kept = sorted_logits[:keep].log_softmax(-1)
            position = order[:keep].tolist().index(token)  # sampled token was kept
            assert gen.logprobs[step] == pytest.approx(float(kept[position]), abs=1e-4)
            top = gen.top_logprobs[step]
            assert [i for i, _ in top] == order[: min(3, keep)].tolist()
            assert [lp for _, lp in top] == pytest.approx(kept[:3].tolist(), abs=1e-4)


async def test_greedy_batched_equals_one_at_a_time(tiny_engine, prompts):
    sampling = SamplingParams(max_new_tokens=12, temperature=0)
    alone = [await tiny_engine.generate(p, sampling) for p in prompts]
    batched = await generate_all(tiny_engine, prompts, sampling)
    assert [g.output_ids for g in batched] == [g.output_ids for g in alone]
    for a, b in zip(alone, batched, strict=True):
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)


async def test_greedy_logprobs_are_untempered(tiny_engine, tiny_model, prompts):
    gen = await tiny_engine.generate(prompts[0], SamplingParams(max_new_tokens=6, temperature=0))
    expected = teacher_forced_logprobs(tiny_model, gen)
    assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("layout", "kernels"), [("packed", "cpu"), ("plain", "cpu"), ("plain", "portable")]
)
async def test_bfloat16_engine_logprobs_are_close_to_float32(tiny_model, prompts, layout, kernels):
    if layout == "packed" and not probe("cpu", *layer_shape(tiny_model.config)).can_pack(
        "bfloat16"
    ):
        pytest.skip("oneDNN cannot pack bfloat16 weights on this CPU (no AVX-512 BW/VL/DQ)")
    engine = LocalEngine(
        tiny_model, eos_token_ids=[], dtype="bfloat16", weight_layout=layout, kernels=kernels
    )
    assert engine.weight_layout == layout
    gens = await generate_all(engine, prompts[:3], SamplingParams(max_new_tokens=8))
    await engine.stop()
    assert next(tiny_model.parameters()).dtype == torch.float32  # the engine has its own copy
    for gen in gens:
        expected = teacher_forced_logprobs(tiny_model, gen)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=0.05, rtol=0)


async def test_requests_join_a_running_batch(tiny_engine, prompts):
    """A request arriving mid-decode joins the batch and gets the same greedy tokens."""
    greedy = SamplingParams(max_new_tokens=40, temperature=0)
    alone = [await tiny_engine.generate(p, greedy) for p in prompts[:3]]
    first = asyncio.create_task(tiny_engine.generate(prompts[0], greedy))
    await tiny_engine.generate(prompts[1], SamplingParams(max_new_tokens=2, temperature=0))
    late = await generate_all(tiny_engine, prompts[1:3], greedy)  # join `first` mid-way
    assert [g.output_ids for g in [await first, *late]] == [g.output_ids for g in alone]


async def test_top_k_1_equals_greedy(tiny_engine, prompts):
    greedy = await generate_all(tiny_engine, prompts, SamplingParams(16, temperature=0))
    top1 = await generate_all(tiny_engine, prompts, SamplingParams(16, temperature=1, top_k=1))
    assert [g.output_ids for g in top1] == [g.output_ids for g in greedy]
    assert all(lp == 0.0 for g in top1 for lp in g.logprobs)
    one = await tiny_engine.generate(prompts[0], SamplingParams(4, top_k=1, top_logprobs=5))
    assert one.top_logprobs == [[(t, 0.0)] for t in one.output_ids]


async def test_seeded_sampling_is_independent_of_the_batch(tiny_engine, prompts):
    seeded = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1234)
    alone = await tiny_engine.generate(prompts[0], seeded)
    others = [tiny_engine.generate(p, SamplingParams(16, seed=i)) for i, p in enumerate(prompts)]
    in_batch, twin, *_ = await asyncio.gather(
        tiny_engine.generate(prompts[0], seeded), tiny_engine.generate(prompts[0], seeded), *others
    )
    assert in_batch.output_ids == alone.output_ids == twin.output_ids
    unseeded = await generate_all(tiny_engine, [prompts[0]] * 2, SamplingParams(16))
    assert unseeded[0].output_ids != unseeded[1].output_ids


async def test_finish_reasons(tiny_model, tokenizer, tiny_engine, prompts):
    prompt = prompts[2]
    ref = await tiny_engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0))
    assert ref.finish_reason == "length" and len(ref.output_ids) == 12

    stop_id = ref.output_ids[5]
    cut = ref.output_ids.index(stop_id) + 1
    by_id = await tiny_engine.generate(
        prompt, SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[stop_id])
    )
    assert (by_id.output_ids, by_id.finish_reason) == (ref.output_ids[:cut], "stop")

    text = tokenizer.decode(ref.output_ids[6:8])
    cut = next(n for n in range(1, 13) if text in tokenizer.decode(ref.output_ids[:n]))
    by_text = await tiny_engine.generate(
        prompt, SamplingParams(max_new_tokens=12, temperature=0, stop=[text])
    )
    assert (by_text.output_ids, by_text.finish_reason) == (ref.output_ids[:cut], "stop")

    eos_engine = LocalEngine(tiny_model, eos_token_ids=[ref.output_ids[3]], dtype="float32")
    by_eos = await eos_engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0))
    await eos_engine.stop()
    cut = ref.output_ids.index(ref.output_ids[3]) + 1
    assert (by_eos.output_ids, by_eos.finish_reason) == (ref.output_ids[:cut], "stop")


async def test_update_weights_changes_output_and_versions(
    tiny_engine, tiny_model, other_tiny_model, prompts
):
    other = other_tiny_model
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    before = await tiny_engine.generate(prompts[0], greedy)
    assert before.versions == [0] * 12

    await tiny_engine.update_weights(other.state_dict(), version=1)
    after = await tiny_engine.generate(prompts[0], greedy)
    assert tiny_engine.version == 1 and after.versions == [1] * 12
    assert after.output_ids != before.output_ids
    assert torch.allclose(
        torch.tensor(after.logprobs), teacher_forced_logprobs(other, after), atol=1e-4
    )

    await tiny_engine.update_weights(tiny_model.state_dict(), version=2)
    again = await tiny_engine.generate(prompts[0], greedy)
    assert again.output_ids == before.output_ids and again.versions == [2] * 12


async def test_update_weights_mid_generation_tags_tokens(
    tiny_engine, tiny_model, other_tiny_model, prompts
):
    """Tokens before the update carry version 0, after it version 1, each matching its weights."""
    other = other_tiny_model
    long = asyncio.create_task(
        tiny_engine.generate(prompts[0], SamplingParams(max_new_tokens=200, temperature=0))
    )
    # Answered at the first step boundary, when `long` holds exactly one token.
    await tiny_engine.generate(prompts[1], SamplingParams(max_new_tokens=1, temperature=0))
    await tiny_engine.update_weights(other.state_dict(), version=1)
    gen = await long
    switch = gen.versions.index(1)
    assert 1 <= switch <= 3 and gen.versions == [0] * switch + [1] * (200 - switch)
    tf0, tf1 = teacher_forced_logprobs(tiny_model, gen), teacher_forced_logprobs(other, gen)
    logprobs = torch.tensor(gen.logprobs)
    assert torch.allclose(logprobs[:switch], tf0[:switch], atol=1e-4)
    assert torch.allclose(logprobs[switch:], tf1[switch:], atol=1e-4)


async def test_weight_update_interrupts_every_running_generation(
    tiny_engine, tiny_model, other_tiny_model, prompts
):
    """Three generations in flight when the weights change: each stops at a token
    boundary, goes on under the new weights, and ends with every token it asked for,
    once; each token's version and logprob belong to the weights that sampled it."""
    lengths = [200, 150, 120]
    running = [
        asyncio.create_task(
            tiny_engine.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0))
        )
        for prompt, n in zip(prompts, lengths, strict=False)
    ]
    await tiny_engine.generate(prompts[3], SamplingParams(max_new_tokens=1, temperature=0))
    await tiny_engine.update_weights(other_tiny_model.state_dict(), version=1)
    gens = await asyncio.gather(*running)
    for gen, n in zip(gens, lengths, strict=True):
        assert len(gen.output_ids) == n and gen.finish_reason == "length"
        switch = gen.versions.index(1)
        assert 1 <= switch < 10 and gen.versions == [0] * switch + [1] * (n - switch)
        before = teacher_forced_logprobs(tiny_model, gen)
        after = teacher_forced_logprobs(other_tiny_model, gen)
        logprobs = torch.tensor(gen.logprobs)
        assert torch.allclose(logprobs[:switch], before[:switch], atol=1e-4)
        assert torch.allclose(logprobs[switch:], after[switch:], atol=1e-4)
        # The two weights disagree on these tokens, so the checks above tell them apart.
        assert not torch.allclose(after[switch:], before[switch:], atol=1e-2)


async def test_pause_holds_decoding_until_resume(tiny_engine, tiny_model, prompts):
    await tiny_engine.pause()
    pending = asyncio.create_task(tiny_engine.generate(prompts[0], SamplingParams(4)))
    await asyncio.sleep(0.1)
    assert not pending.done()
    await tiny_engine.update_weights(tiny_model.state_dict(), version=5)
    await tiny_engine.resume()
    assert (await pending).versions == [5] * 4


@pytest.mark.parametrize(
    ("impl", "kernels"), [("fused", "cpu"), ("fused", "portable"), ("hf", "cpu")]
)
async def test_kv_budget(tiny_model, prompts, impl, kernels):
    engine = LocalEngine(
        tiny_model,
        eos_token_ids=[],
        max_tokens_per_batch=100,
        impl=impl,
        kernels=kernels,
        dtype="float32",
    )
    too_big = SamplingParams(max_new_tokens=101 - len(prompts[0]), temperature=0)
    with pytest.raises(EngineError, match="max_tokens_per_batch=100"):
        await engine.generate(prompts[0], too_big)
    # Each fills more than half the budget, so they must run one after another.
    sampling = SamplingParams(max_new_tokens=60 - len(prompts[0]), temperature=0)
    gens = await generate_all(engine, [prompts[0]] * 4, sampling)
    await engine.stop()
    assert all(g.output_ids == gens[0].output_ids for g in gens)
    assert all(g.finish_reason == "length" for g in gens)


async def test_invalid_prompts(tiny_engine, prompts):
    with pytest.raises(EngineError, match="empty"):
        await tiny_engine.generate([], SamplingParams())
    with pytest.raises(EngineError, match="1024"):  # tiny model's max_position_embeddings
        await tiny_engine.generate(prompts[0], SamplingParams(max_new_tokens=1024))
    with pytest.raises(EngineError, match="vocabulary"):
        await tiny_engine.generate([10**9], SamplingParams())


async def test_step_failure_reaches_every_caller(tiny_engine, prompts, monkeypatch):
    def broken_forward(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(tiny_engine._runner, "prefill", broken_forward)
    results = await asyncio.gather(
        *(tiny_engine.generate(p, SamplingParams(4)) for p in prompts[:3]), return_exceptions=True
    )
    for result in results:  # a failed step is not a dead engine: it serves the next request
        assert isinstance(result, EngineError) and "boom" in str(result)
        assert not isinstance(result, EngineUnavailable)
        assert isinstance(result.__cause__, RuntimeError)
    monkeypatch.undo()
    assert len((await tiny_engine.generate(prompts[0], SamplingParams(4))).output_ids) == 4


async def test_stop_fails_waiting_requests(tiny_engine, prompts):
    await tiny_engine.pause()
    pending = asyncio.create_task(tiny_engine.generate(prompts[0], SamplingParams(4)))
    await asyncio.sleep(0.05)
    await tiny_engine.stop()
    with pytest.raises(EngineUnavailable, match="stopped"):
        await pending


@pytest.mark.parametrize("kernels", ["cpu", "portable"])
async def test_fused_kv_cache_stays_within_budget(tiny_model, prompts, kernels):
    """Many requests against a small budget: all finish, the cache never outgrows it.
    Rows finish at different steps, so slots free up and are taken again out of order."""
    budget = 400
    engine = LocalEngine(
        tiny_model, eos_token_ids=[], max_tokens_per_batch=budget, kernels=kernels, dtype="float32"
    )
    cache = engine._runner.cache
    config = tiny_model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    peak = 0
    reserve = cache.reserve

    def measuring_reserve(slots: int, columns: int) -> None:
        nonlocal peak
        reserve(slots, columns)
        peak = max(peak, cache.nbytes)

    cache.reserve = measuring_reserve
    sampling = SamplingParams(max_new_tokens=40, temperature=0)
    gens = await generate_all(engine, prompts * 3, sampling)
    await engine.stop()
    assert [len(g.output_ids) for g in gens] == [40] * len(prompts) * 3
    assert 0 < peak <= budget * per_token
    alone = LocalEngine(tiny_model, eos_token_ids=[], dtype="float32")
    expected = [await alone.generate(p, sampling) for p in prompts]
    await alone.stop()
    assert [g.output_ids for g in gens] == [g.output_ids for g in expected] * 3


def count_prefills(engine: LocalEngine) -> tuple[list[int], list[int]]:
    """Rows and real tokens of each prefill forward `engine` runs from now on."""
    rows: list[int] = []
    tokens: list[int] = []
    decoder_prefill = engine._runner._decoder.prefill

    def counting_prefill(cache, ids, lengths, *args):
        rows.append(ids.shape[0])
        tokens.append(int(lengths.sum()))
        return decoder_prefill(cache, ids, lengths, *args)

    engine._runner._decoder.prefill = counting_prefill
    return rows, tokens


@pytest.mark.parametrize("kernels", ["cpu", "portable"])
async def test_prefix_store_skips_shared_and_earlier_tokens(
    tiny_model, other_tiny_model, prompts, kernels
):
    """The system prompt every prompt shares is prefilled once; a next turn that extends
    a finished sequence prefills only its new tokens; a weight update empties the store.
    Outputs and logprobs stay those of an engine without the store."""
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    options = dict(eos_token_ids=[], dtype="float32", kernels=kernels)
    plain = LocalEngine(tiny_model, prefix_cache_tokens=0, **options)
    engine = LocalEngine(tiny_model, **options)
    store = engine._runner.prefixes
    rows, tokens = count_prefills(engine)
    shared = len(os.path.commonprefix(prompts))
    assert shared >= store.min_tokens  # the chat template's system prompt

    first = await generate_all(engine, prompts, greedy)
    assert rows == [1, len(prompts)]  # the shared prefix alone, then every suffix
    assert tokens == [shared, sum(len(p) - shared for p in prompts)]
    expected = await generate_all(plain, prompts, greedy)
    assert [g.output_ids for g in first] == [g.output_ids for g in expected]

    # Turn two: the first turn's tokens plus a new message. The store holds the first
    # turn up to its last sampled token, which was never fed back.
    turn = first[3].prompt_ids + first[3].output_ids + prompts[0][shared:]
    rows.clear()
    tokens.clear()
    second = await engine.generate(turn, greedy)
    assert tokens == [len(prompts[0]) - shared + 1]
    assert second.output_ids == (await plain.generate(turn, greedy)).output_ids
    expected_logprobs = teacher_forced_logprobs(tiny_model, second)
    assert torch.allclose(torch.tensor(second.logprobs), expected_logprobs, atol=1e-4, rtol=0)

    await engine.update_weights(other_tiny_model.state_dict(), version=1)
    assert len(store) == 0
    rows.clear()
    tokens.clear()
    after = await engine.generate(turn, greedy)
    assert tokens == [len(turn)]  # nothing computed under the old weights is reused
    expected_logprobs = teacher_forced_logprobs(other_tiny_model, after)
    assert torch.allclose(torch.tensor(after.logprobs), expected_logprobs, atol=1e-4, rtol=0)
    await engine.stop()
    await plain.stop()


def assert_same_draws(batched: list[list[int]], alone: list[list[int]]) -> None:
    """Seeded samples drawn in a batch are those drawn alone: the same tokens, except where
    a draw fell within float rounding of a boundary of the inverse CDF (sampling.py sums
    the probabilities in token-id order), which moves it to the neighbouring id, after
    which the sequence goes its own way. The matmuls of a batch of 4 and of 1 round
    differently on some CPUs (forced AVX2 on an AMX Xeon: the last draw of 40 moved from
    43580 to 43579); a wrong seed or row would change most draws, not one to its
    neighbour. At most one such move over the whole comparison."""
    moved = 0
    for a, b in zip(batched, alone, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if first is not None:
            assert abs(a[first] - b[first]) == 1, (first, a, b)
            moved += 1
    assert moved <= 1, (batched, alone)


@pytest.mark.parametrize("kernels", ["cpu", "portable"])
async def test_identical_prompts_share_one_prefill(tiny_model, prompts, kernels):
    """A group's samples are prefilled once; each still matches its prompt run alone."""
    engine = LocalEngine(
        tiny_model, eos_token_ids=[], prefix_cache_tokens=0, kernels=kernels, dtype="float32"
    )
    prefilled_rows = count_prefills(engine)[0]
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    group = [prompts[0]] * 4 + [prompts[1]] * 4
    gens = await generate_all(engine, group, greedy)
    seeded = [SamplingParams(10, seed=i) for i in range(4)]
    sampled = await asyncio.gather(*(engine.generate(prompts[2], s) for s in seeded))
    alone = [await engine.generate(prompts[2], s) for s in seeded]
    await engine.stop()
    assert prefilled_rows[:2] == [2, 1]  # 8 requests -> 2 distinct prompts; 4 -> 1
    assert [g.output_ids for g in gens] == [gens[0].output_ids] * 4 + [gens[4].output_ids] * 4
    assert_same_draws([g.output_ids for g in sampled], [g.output_ids for g in alone])
    for gen in [*gens, *sampled]:
        expected = teacher_forced_logprobs(tiny_model, gen)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4, rtol=0)


# ---- one request's fault fails that request only ----------------------------------------


def _poison(runner, method: str, poisoned: list[int], monkeypatch, fault: str) -> None:
    """Make `runner.method` fail (fault "raise") or return NaN logits (fault "nan") for
    any row whose sequence starts with `poisoned`: a fault no valid input reaches, to
    test what the engine does when one happens anyway."""
    real = getattr(runner, method)

    def forward(sequences, *args, **kwargs):
        hit = [i for i, seq in enumerate(sequences) if seq[: len(poisoned)] == poisoned]
        if hit and fault == "raise":
            raise RuntimeError("poisoned row")
        logits = real(sequences, *args, **kwargs)
        if hit:
            logits[hit] = float("nan")
        return logits

    monkeypatch.setattr(runner, method, forward)


@pytest.mark.parametrize("fault", ["raise", "nan"])
async def test_a_failing_row_fails_only_its_request(tiny_engine, prompts, monkeypatch, fault):
    sampling = [SamplingParams(max_new_tokens=8, seed=10 + i) for i in range(3)]
    alone = [await tiny_engine.generate(p, s) for p, s in zip(prompts[:3], sampling, strict=True)]
    _poison(tiny_engine._runner, "prefill", prompts[1], monkeypatch, fault)
    # The first request is already decoding when the poisoned one joins the batch.
    first = asyncio.create_task(tiny_engine.generate(prompts[0], sampling[0]))
    while not tiny_engine._rows:
        await asyncio.sleep(0.001)
    results = await asyncio.gather(
        first,
        tiny_engine.generate(prompts[1], sampling[1]),
        tiny_engine.generate(prompts[2], sampling[2]),
        return_exceptions=True,
    )
    assert isinstance(results[1], EngineError), results[1]
    assert not isinstance(results[1], EngineUnavailable)
    assert ("poisoned row" if fault == "raise" else "not finite") in str(results[1])
    for i in (0, 2):  # the others finish with what they sample alone (seeded)
        assert isinstance(results[i], Generation), results[i]
        assert results[i].output_ids == alone[i].output_ids
        assert results[i].logprobs == pytest.approx(alone[i].logprobs, abs=1e-5)


async def test_extreme_sampling_values_share_a_batch(tiny_engine, prompts):
    """top_k of 2**63 overflowed the engine's tensors and a temperature of 1e-40 turned
    logits to inf (NaN logprobs); both failed every request in the batch."""
    plain = SamplingParams(max_new_tokens=6, seed=3)
    huge_k = SamplingParams(max_new_tokens=6, seed=3, top_k=2**63)
    tiny_t = SamplingParams(max_new_tokens=6, temperature=1e-40, top_logprobs=2)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, top_logprobs=2)
    reference = await generate_all(tiny_engine, [prompts[0], prompts[1]], plain)
    greedy_gen = await tiny_engine.generate(prompts[2], greedy)
    gens = await asyncio.gather(
        tiny_engine.generate(prompts[0], plain),
        tiny_engine.generate(prompts[1], huge_k),
        tiny_engine.generate(prompts[2], tiny_t),
    )
    assert gens[0].output_ids == reference[0].output_ids
    assert gens[1].output_ids == reference[1].output_ids  # top_k beyond the vocabulary: none
    assert gens[2].output_ids == greedy_gen.output_ids
    assert gens[2].logprobs == pytest.approx(greedy_gen.logprobs, abs=1e-5)
    assert all(torch.isfinite(torch.tensor(g.logprobs)).all() for g in gens)


# ---- the portable kernels, weight updates in place, collocation hooks -------------------


async def test_greedy_equals_hugging_face_generate(tiny_engine, tiny_model, tokenizer, prompts):
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    gens = await generate_all(tiny_engine, prompts[:3], greedy)
    for prompt, gen in zip(prompts[:3], gens, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = tiny_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=12,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        assert gen.output_ids == out[0, len(prompt) :].tolist()


def test_kernels_are_decided_before_the_engine(tiny_model, tokenizer):
    with pytest.raises(ValueError, match="engine.kernels=auto is decided at start-up"):
        LocalEngine(tiny_model, eos_token_ids=[], kernels="auto")
    with pytest.raises(ValueError, match="engine.weight_layout=packed .* portable"):
        LocalEngine(tiny_model, eos_token_ids=[], weight_layout="packed", kernels="portable")
    precision = EnginePrecision(
        dtype="float32", weight_layout="plain", reason="test", kernels="portable"
    )
    engine = LocalEngine.for_model(tiny_model, tokenizer, EngineConfig(), precision)
    assert engine.kernels == "portable" and engine._runner._decoder.kernels == "portable"
    hf = LocalEngine(tiny_model, eos_token_ids=[], impl="hf", kernels="portable")
    assert hf.kernels == "portable"  # the Hugging Face forward has no kernels to choose


@pytest.mark.parametrize("kernels", ["cpu", "portable"])
async def test_weight_updates_write_into_the_fused_weights(
    tiny_model, other_tiny_model, prompts, kernels
):
    """Plain fused weights are written in place by update_weights: the same tensors
    afterwards (no allocation), and the engine then samples what an engine built on the
    new weights samples."""
    options = dict(eos_token_ids=[], dtype="float32", weight_layout="plain", kernels=kernels)
    engine = LocalEngine(tiny_model, **options)
    decoder = engine._runner._decoder
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    built = [w.data_ptr() for w in decoder.weights()]
    memory = engine.memory_bytes()["weights"]
    before = await generate_all(engine, prompts[:3], greedy)
    await engine.update_weights(other_tiny_model.state_dict(), version=1)
    await engine.update_weights(tiny_model.state_dict(), version=2)
    assert [g.output_ids for g in await generate_all(engine, prompts[:3], greedy)] == [
        g.output_ids for g in before
    ]
    await engine.update_weights(other_tiny_model.state_dict(), version=3)
    assert [w.data_ptr() for w in decoder.weights()] == built
    assert engine.memory_bytes()["weights"] == memory
    fresh = LocalEngine(other_tiny_model, **options)
    got = await generate_all(engine, prompts[:3], greedy)
    want = await generate_all(fresh, prompts[:3], greedy)
    await engine.stop()
    await fresh.stop()
    assert [g.output_ids for g in got] == [g.output_ids for g in want]
    assert [g.output_ids for g in got] != [g.output_ids for g in before]
    for g, w in zip(got, want, strict=True):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)


def kv_bytes_per_token(config) -> int:
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # float32


@pytest.mark.parametrize("forward", ["fused-packed", "fused-portable", "hf"])
async def test_memory_bytes_counts_each_weight_once_and_the_kv_cache(tiny_model, prompts, forward):
    impl, layout, *_ = FORWARDS[forward]
    if layout == "packed" and not probe("cpu", *layer_shape(tiny_model.config)).can_pack("float32"):
        pytest.skip("oneDNN cannot pack float32 weights on this CPU")
    engine = forward_engine(tiny_model, forward, eos_token_ids=[])
    size = {name: p.numel() * 4 for name, p in tiny_model.named_parameters()}
    fused_copies = {  # what the fused forward holds besides the model's own tensors
        "fused-packed": [n for n in size if n.endswith("proj.weight") or n == "lm_head.weight"],
        "fused-portable": [n for n in size if n.split(".")[-2] in ("q_proj", "k_proj", "v_proj")]
        + [n for n in size if n.split(".")[-2] in ("gate_proj", "up_proj")],
        "hf": [],
    }[forward]
    memory = engine.memory_bytes()
    assert memory == {
        "weights": sum(size.values()) + sum(size[n] for n in fused_copies),
        "kv_cache": 0,
    }

    per_token = kv_bytes_per_token(tiny_model.config)
    greedy = SamplingParams(max_new_tokens=40, temperature=0)
    running = asyncio.create_task(engine.generate(prompts[0], greedy))
    await engine.generate(prompts[1], SamplingParams(max_new_tokens=1, temperature=0))
    assert engine.memory_bytes()["kv_cache"] >= per_token * len(prompts[0])  # mid-generation
    await running
    idle = engine.memory_bytes()["kv_cache"]  # the fused cache keeps its memory, HF's not
    assert idle == (engine._runner.cache.nbytes if impl == "fused" else 0)
    await engine.stop()


@pytest.mark.parametrize("forward", ["fused-plain", "fused-portable", "fused-static", "hf"])
async def test_set_kv_budget_takes_effect_at_a_step_boundary(tiny_model, prompts, forward):
    """Lowered while two rows run: both finish with what they sample alone, a waiting
    request that no longer fits fails, new requests are validated against the new budget,
    and the cache memory goes back once the batch is empty; raised again, long requests
    run again."""
    engine = forward_engine(tiny_model, forward, eos_token_ids=[], max_tokens_per_batch=1000)
    per_token = kv_bytes_per_token(tiny_model.config)
    long = SamplingParams(max_new_tokens=60, temperature=0)
    alone = [await engine.generate(p, long) for p in prompts[:2]]
    running = [asyncio.create_task(engine.generate(p, long)) for p in prompts[:2]]
    await engine.generate(prompts[3], SamplingParams(max_new_tokens=1, temperature=0))
    held = engine.memory_bytes()["kv_cache"]
    await engine.pause()
    doomed = asyncio.create_task(engine.generate(prompts[2], long))  # validated, waiting
    await asyncio.sleep(0.01)
    small = len(prompts[3]) + 10
    await engine.set_kv_budget(small)
    assert engine.memory_bytes()["kv_cache"] == held  # rows running: nothing released yet
    with pytest.raises(EngineError, match=f"max_tokens_per_batch={small}"):
        await engine.generate(prompts[0], long)
    fits = asyncio.create_task(engine.generate(prompts[3], SamplingParams(10, temperature=0)))
    await engine.resume()
    gens = await asyncio.gather(*running)
    assert [g.output_ids for g in gens] == [g.output_ids for g in alone]
    with pytest.raises(EngineError, match=f"lowered to {small}"):
        await doomed
    assert len((await fits).output_ids) == 10
    assert engine.memory_bytes()["kv_cache"] <= per_token * small < held
    with pytest.raises(ValueError, match="set_kv_budget"):
        await engine.set_kv_budget(0)
    await engine.set_kv_budget(1000)
    assert (await engine.generate(prompts[0], long)).output_ids == alone[0].output_ids
    await engine.stop()
