"""The fused forward against the Hugging Face forward of the same random weights.

Each supported architecture's quirk is exercised: Qwen2's q/k/v biases, Qwen3's per-head
q/k norms and explicit head_dim, grouped-query attention everywhere.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    MistralForCausalLM,
)

from looprl.engines.local.fused import FusedDecoder, SlotCache, unsupported_reason
from looprl.precision import probe
from tests.support.architectures import MODELS, SIZES

pytestmark = pytest.mark.kernels  # run again on a forced AVX2 CPU by make test


def packs(dtype: str) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU (bfloat16: not on AVX2 alone)."""
    return probe("cpu", SIZES["hidden_size"], SIZES["intermediate_size"]).can_pack(dtype)


def layouts(dtype: str) -> list:
    """Both weight layouts; packed is skipped, saying why, where `dtype` cannot pack."""
    why = f"oneDNN cannot pack {dtype} weights on this CPU"
    skip = [] if packs(dtype) else [pytest.mark.skip(reason=why)]
    return [pytest.param(False, id="plain"), pytest.param(True, id="packed", marks=skip)]


@pytest.mark.parametrize("packed", layouts("float32"))
@pytest.mark.parametrize("arch", MODELS)
def test_prefill_and_decode_match_the_hugging_face_forward(arch, packed):
    torch.manual_seed(0)
    model = MODELS[arch]().eval()
    if arch == "qwen2":  # random init leaves biases at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    decoder = FusedDecoder(model, packed=packed)
    cache = SlotCache(decoder, budget_tokens=10_000)
    sequences = [torch.randint(0, 300, (n,)).tolist() for n in (9, 4, 13)]
    slots = torch.tensor([3, 0, 1])  # any free slots, in any order
    cache.reserve(4, 20)
    width = max(map(len, sequences))
    ids = torch.zeros(3, width, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s in sequences])
    prefill = decoder.prefill(cache, ids, lengths, slots)
    nxt = prefill.argmax(-1)
    decode = decoder.decode(cache, nxt, lengths, slots)
    for i, s in enumerate(sequences):
        with torch.no_grad():
            ref = model(torch.tensor([s + [int(nxt[i])]])).logits[0]
        torch.testing.assert_close(prefill[i], ref[-2], atol=1e-4, rtol=0)
        torch.testing.assert_close(decode[i], ref[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("packed", layouts("float32"))
@pytest.mark.parametrize("arch", MODELS)
def test_prefill_after_a_cached_prefix_matches_the_hugging_face_forward(arch, packed):
    """Rows continue from K/V already in their slots (a reused prefix), each from its own
    position; one row starts from scratch in the same call."""
    torch.manual_seed(1)
    model = MODELS[arch]().eval()
    decoder = FusedDecoder(model, packed=packed)
    cache = SlotCache(decoder, budget_tokens=10_000)
    cache.reserve(3, 24)
    sequences = [torch.randint(0, 300, (n,)).tolist() for n in (11, 7, 15)]
    starts = [6, 0, 3]
    slots = torch.tensor([2, 0, 1])
    prefix = torch.zeros(3, 6, dtype=torch.long)
    for i, (s, start) in enumerate(zip(sequences, starts, strict=True)):
        prefix[i, : max(start, 1)] = torch.tensor(s[: max(start, 1)])
    decoder.prefill(cache, prefix, torch.tensor([6, 1, 3]), slots)  # the cached prefixes
    width = max(len(s) - start for s, start in zip(sequences, starts, strict=True))
    ids = torch.zeros(3, width, dtype=torch.long)
    for i, (s, start) in enumerate(zip(sequences, starts, strict=True)):
        ids[i, : len(s) - start] = torch.tensor(s[start:])
    lengths = torch.tensor([len(s) - start for s, start in zip(sequences, starts, strict=True)])
    logits = decoder.prefill(cache, ids, lengths, slots, torch.tensor(starts))
    nxt = logits.argmax(-1)
    decode = decoder.decode(cache, nxt, torch.tensor([len(s) for s in sequences]), slots)
    for i, s in enumerate(sequences):
        with torch.no_grad():
            ref = model(torch.tensor([s + [int(nxt[i])]])).logits[0]
        torch.testing.assert_close(logits[i], ref[-2], atol=1e-4, rtol=0)
        torch.testing.assert_close(decode[i], ref[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("packed", layouts("bfloat16"))
def test_bfloat16_forward_is_as_close_to_float32_as_hugging_faces_bfloat16(packed):
    """In bfloat16, packed or plain, the fused logits are as far from the float32 forward
    as the Hugging Face bfloat16 forward's are (the error is the dtype's)."""
    torch.manual_seed(2)
    model = MODELS["llama"]().eval()
    sequence = torch.randint(0, 300, (12,)).tolist()
    with torch.no_grad():
        want = model(torch.tensor([sequence])).logits[0, -1]
        hf_error = (
            (model.to(torch.bfloat16)(torch.tensor([sequence])).logits[0, -1].float() - want)
            .abs()
            .max()
        )
    decoder = FusedDecoder(model, packed=packed)
    assert decoder.dtype == torch.bfloat16
    cache = SlotCache(decoder, budget_tokens=1000)
    cache.reserve(1, 16)
    logits = decoder.prefill(cache, torch.tensor([sequence]), torch.tensor([12]), torch.tensor([0]))
    error = (logits[0] - want).abs().max()
    assert 0 < error < max(2 * hf_error, 0.05)


def test_packed_weights_are_refused_off_the_cpu():
    model = MODELS["llama"]().eval().to("meta")
    with pytest.raises(ValueError, match="oneDNN's CPU layout"):
        FusedDecoder(model, packed=True)


def test_unsupported_models_say_why():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert "gpt2" in unsupported_reason(gpt2.config)
    windowed = MistralForCausalLM(MistralConfig(**SIZES, sliding_window=16))
    assert "sliding-window" in unsupported_reason(windowed.config)
    with pytest.raises(ValueError, match="sliding-window"):
        FusedDecoder(windowed)
    assert unsupported_reason(MODELS["llama"]().config) is None


def test_slot_cache_grows_within_budget_and_keeps_contents():
    torch.manual_seed(0)
    decoder = FusedDecoder(MODELS["llama"]().eval())
    roomy = SlotCache(decoder, budget_tokens=1000)
    roomy.reserve(2, 30)
    assert roomy.shape == (8, 64)  # rounded up: 512 tokens fit the budget
    tight = SlotCache(decoder, budget_tokens=130)
    tight.reserve(2, 30)
    assert tight.shape == (2, 64)  # columns rounded up; 8 slots would pass 130 tokens
    tight.k[:, 1, :, :, 29] = 7.0
    tight.v[:, 1, :, 29] = 8.0
    tight.reserve(3, 30)
    assert tight.shape == (3, 30)  # a third row: the 2 rounding columns no longer fit
    assert (tight.k[:, 1, :, :, 29] == 7.0).all() and (tight.v[:, 1, :, 29] == 8.0).all()
    assert (tight.k[:, 2] == 0).all() and (tight.v[:, 2] == 0).all()
    tight.copy_slots(torch.tensor([1]), torch.tensor([2]), 30)
    assert (tight.k[:, 2] == tight.k[:, 1]).all() and (tight.v[:, 2] == tight.v[:, 1]).all()
    assert tight.nbytes == 2 * 3 * 30 * 2 * 2 * 16 * 4  # K+V, slots, columns, layers, kv, d
    assert tight.fits(3, 43) and not tight.fits(4, 33)

    # With no rows left the memory is kept and viewed in the next batch's shape.
    storage = tight.v.data_ptr()
    tight.clear()
    assert tight.shape == (0, 0) and tight.nbytes == 2 * 3 * 30 * 2 * 2 * 16 * 4
    tight.reserve(4, 20)
    assert tight.shape == (4, 20) and tight.v.data_ptr() == storage
    assert tight.k.is_contiguous() and tight.v.is_contiguous()
    assert torch.isfinite(tight.v).all()  # masked leftovers, never NaN (0 x NaN = NaN)
    tight.release()
    assert tight.shape == (0, 0) and tight.nbytes == 0
