"""The fused forward against the Hugging Face forward of the same random weights, with
each set of kernels: cpu (packed or plain weights, batched-matmul decode over K stored
transposed) and portable (plain torch, scaled_dot_product_attention over the cache).

Each supported architecture's quirk is exercised: Qwen2's q/k/v biases, Qwen3's per-head
q/k norms and explicit head_dim, grouped-query attention everywhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    MistralForCausalLM,
)

from looprl import adapters
from looprl.engines.local.fused import FusedDecoder, unsupported_reason
from looprl.engines.local.kv_cache import SlotCache
from looprl.precision import probe
from looprl.types import LoraAdapter
from tests.support.architectures import MODELS, SIZES

pytestmark = pytest.mark.kernels  # run again on a forced AVX2 CPU by make test


def packs(dtype: str) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU (bfloat16: not on AVX2 alone)."""
    return probe("cpu", SIZES["hidden_size"], SIZES["intermediate_size"]).can_pack(dtype)


def forwards(dtype: str) -> list:
    """(kernels, packed): cpu with packed weights (skipped, saying why, where `dtype`
    cannot pack), cpu with plain weights, portable (always plain)."""
    why = f"oneDNN cannot pack {dtype} weights on this CPU"
    skip = [] if packs(dtype) else [pytest.mark.skip(reason=why)]
    return [
        pytest.param("cpu", True, id="cpu-packed", marks=skip),
        pytest.param("cpu", False, id="cpu-plain"),
        pytest.param("portable", False, id="portable"),
    ]


def right_padded(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (B, longest) right-padded with 0, and lengths (B,)."""
    ids = torch.zeros(len(sequences), max(map(len, sequences)), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
    return ids, torch.tensor([len(s) for s in sequences])


@pytest.mark.parametrize(("kernels", "packed"), forwards("float32"))
@pytest.mark.parametrize("arch", MODELS)
def test_prefill_and_decode_match_the_hugging_face_forward(arch, kernels, packed):
    """Three rows in slots 3, 0 and 1 (slot 2 free: a zero query row at decode), of
    different lengths: the columns past a short row's length hold the padding's K/V,
    which only its attention mask keeps out."""
    torch.manual_seed(0)
    model = MODELS[arch]().eval()
    if arch == "qwen2":  # random init leaves biases at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    decoder = FusedDecoder(model, packed=packed, kernels=kernels)
    cache = SlotCache(decoder, budget_tokens=10_000)
    sequences = [torch.randint(0, 300, (n,)).tolist() for n in (9, 4, 13)]
    slots = torch.tensor([3, 0, 1])  # any free slots, in any order
    cache.reserve(4, 20)
    ids, lengths = right_padded(sequences)
    prefill = decoder.prefill(cache, ids, lengths, slots)
    nxt = prefill.argmax(-1)
    decode = decoder.decode(cache, nxt, lengths, slots)
    for i, s in enumerate(sequences):
        with torch.no_grad():
            ref = model(torch.tensor([s + [int(nxt[i])]])).logits[0]
        torch.testing.assert_close(prefill[i], ref[-2], atol=1e-4, rtol=0)
        torch.testing.assert_close(decode[i], ref[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize(("kernels", "packed"), forwards("float32"))
@pytest.mark.parametrize("arch", MODELS)
def test_prefill_after_a_cached_prefix_matches_the_hugging_face_forward(arch, kernels, packed):
    """Rows continue from K/V already in their slots (a reused prefix), each from its own
    position; one row starts from scratch in the same call."""
    torch.manual_seed(1)
    model = MODELS[arch]().eval()
    decoder = FusedDecoder(model, packed=packed, kernels=kernels)
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


@pytest.mark.parametrize(("kernels", "packed"), forwards("bfloat16"))
def test_bfloat16_forward_is_as_close_to_float32_as_hugging_faces_bfloat16(kernels, packed):
    """In bfloat16, with either kernels, packed or plain, the fused logits are as far from
    the float32 forward as the Hugging Face bfloat16 forward's are (the error is the
    dtype's)."""
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
    decoder = FusedDecoder(model, packed=packed, kernels=kernels)
    assert decoder.dtype == torch.bfloat16
    cache = SlotCache(decoder, budget_tokens=1000)
    cache.reserve(1, 16)
    logits = decoder.prefill(cache, torch.tensor([sequence]), torch.tensor([12]), torch.tensor([0]))
    error = (logits[0] - want).abs().max()
    assert 0 < error < max(2 * hf_error, 0.05)


def test_packed_weights_are_refused_off_the_cpu_and_with_the_portable_kernels():
    model = MODELS["llama"]().eval().to("meta")
    with pytest.raises(ValueError, match="oneDNN's CPU layout"):
        FusedDecoder(model, packed=True)
    with pytest.raises(ValueError, match="engine.weight_layout=packed .* portable"):
        FusedDecoder(MODELS["llama"](), packed=True, kernels="portable")
    with pytest.raises(ValueError, match="kernels='auto'"):
        FusedDecoder(MODELS["llama"](), kernels="auto")


def test_unsupported_models_say_why():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert "gpt2" in unsupported_reason(gpt2.config)
    windowed = MistralForCausalLM(MistralConfig(**SIZES, sliding_window=16))
    assert "sliding-window" in unsupported_reason(windowed.config)
    with pytest.raises(ValueError, match="sliding-window"):
        FusedDecoder(windowed)
    assert unsupported_reason(MODELS["llama"]().config) is None


class AttentionCalls(TorchFunctionMode):
    """Records the scaled_dot_product_attention and matmul calls made inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.sdpa: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self.matmuls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.sdpa.append((args[1], args[2], kwargs.get("attn_mask")))
        elif getattr(func, "__name__", "") == "matmul":
            self.matmuls += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("kernels", ["cpu", "portable"])
def test_decode_attention_reads_the_cache_in_place(kernels):
    """portable: one scaled_dot_product_attention per layer on views of the cache's own
    storage (no gather copy), K as (T, head_dim), one mask row per slot below the highest
    in use (a free slot sees column 0 only); cpu: two matmuls per layer, K transposed."""
    model = MODELS["llama"]().eval()
    decoder = FusedDecoder(model, kernels=kernels)
    cache = SlotCache(decoder, budget_tokens=1000)
    cache.reserve(3, 16)
    ids, lengths = right_padded([[5, 6, 7], [8, 9]])
    slots = torch.tensor([2, 0])  # slot 1 free
    decoder.prefill(cache, ids, lengths, slots)
    with AttentionCalls() as calls:
        decoder.decode(cache, torch.tensor([1, 2]), lengths, slots)
    layers, kv, d = decoder.num_layers, decoder.num_kv_heads, decoder.head_dim
    assert cache.keys.shape == (layers, 8, kv, 64, d)  # logical, in both layouts
    if kernels == "cpu":
        assert cache.k.shape == (layers, 8, kv, d, 64) and cache.k.is_contiguous()
        assert not calls.sdpa and calls.matmuls == 2 * layers
        return
    assert cache.k is cache.keys and cache.keys.is_contiguous()
    assert len(calls.sdpa) == layers and calls.matmuls == 0
    storages = {t.untyped_storage().data_ptr() for t in (cache.keys, cache.v)}
    for key, value, mask in calls.sdpa:
        assert {t.untyped_storage().data_ptr() for t in (key, value)} == storages
        # 4 columns in use, rounded up to WIDTH_STEP (128) but within the cache's 64
        assert key.shape == value.shape == (3, kv, 64, d) and key.stride(-1) == 1
        visible = [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]  # slots 0, 1 (free), 2
        assert mask.shape == (3, 1, 1, 64)
        assert mask[:, 0, 0].int().tolist() == [row + [0] * 60 for row in visible]


def last_logits(decoder: FusedDecoder, sequence: list[int]) -> torch.Tensor:
    cache = SlotCache(decoder, budget_tokens=1000)
    cache.reserve(1, len(sequence))
    ids, lengths = right_padded([sequence])
    return decoder.prefill(cache, ids, lengths, torch.tensor([0]))[0]


def hf_last_logits(model, sequence: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([sequence])).logits[0, -1]


def random_adapter(model, modules: tuple[str, ...], seed: int) -> LoraAdapter:
    """A rank-2 adapter of `modules` (e.g. "q_proj") in every layer, non-zero A and B."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in modules:
            a = torch.randn(2, module.in_features, generator=gen) * 0.3
            tensors[f"{name}.lora_A.weight"] = a
            tensors[f"{name}.lora_B.weight"] = torch.randn(module.out_features, 2, generator=gen)
    return LoraAdapter(tensors, rank=2, alpha=1.0, target_modules=modules)


@pytest.mark.parametrize(("kernels", "packed"), forwards("float32"))
def test_adapters_merge_into_the_fused_weights_and_leave_the_base_alone(kernels, packed):
    """Adapter 1 (q, v, o, up), then adapter 2 (k, o, down), then none: each time the
    forward is the merged model's, the base model is untouched (plain weights are
    written in place, never into a tensor the model owns), and the fused q|k|v and
    gate|up tensors are the same ones throughout."""
    torch.manual_seed(3)
    model = MODELS["qwen2"]().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.normal_(0, 0.5)
    base = {name: t.clone() for name, t in model.state_dict().items()}
    decoder = FusedDecoder(model, packed=packed, kernels=kernels)
    fused = [] if packed else [decoder.layers[0][i].data_ptr() for i in (1, 7)]
    sequence = torch.randint(0, 300, (10,)).tolist()
    merged = MODELS["qwen2"]().eval()
    first = random_adapter(model, ("q_proj", "v_proj", "o_proj", "up_proj"), seed=0)
    second = random_adapter(model, ("k_proj", "o_proj", "down_proj"), seed=1)
    for adapter in (first, second, None):
        decoder.load(model, adapter)
        state = base if adapter is None else adapters.merge(base, adapter)
        merged.load_state_dict(state)
        want = hf_last_logits(merged, sequence)
        torch.testing.assert_close(last_logits(decoder, sequence), want, atol=1e-4, rtol=0)
        assert all(torch.equal(t, base[name]) for name, t in model.state_dict().items())
        if not packed:
            assert [decoder.layers[0][i].data_ptr() for i in (1, 7)] == fused
    assert hf_last_logits(model, sequence).sub(want).abs().max() < 1e-4  # base again


@pytest.mark.parametrize(("kernels", "packed"), forwards("float32"))
def test_reload_after_a_weight_update_writes_into_the_fused_weights(kernels, packed):
    """New weights loaded into the model in place (as update_weights does): the forward
    is the new model's, and plain fused weights (q|k|v with its bias, gate|up) are
    written into the tensors built before, the others are the model's own. (Built
    under inference mode, as a caller may: the tensors are then inference tensors,
    which a write outside it would refuse.)"""
    torch.manual_seed(4)
    model, other = MODELS["qwen2"]().eval(), MODELS["qwen2"]().eval()
    with torch.no_grad():
        for layer in other.model.layers:
            layer.self_attn.k_proj.bias.normal_(0, 0.5)
    with torch.inference_mode():
        decoder = FusedDecoder(model, packed=packed, kernels=kernels)
    built = [] if packed else [t.data_ptr() for t in decoder.weights()]
    model.load_state_dict(other.state_dict())
    decoder.load(model)
    sequence = torch.randint(0, 300, (10,)).tolist()
    want = hf_last_logits(other, sequence)
    torch.testing.assert_close(last_logits(decoder, sequence), want, atol=1e-4, rtol=0)
    if not packed:
        assert [t.data_ptr() for t in decoder.weights()] == built
        own = {p.data_ptr() for p in model.parameters()}
        qkv, bias, o, gu, down = (decoder.layers[0][i] for i in (1, 2, 5, 7, 8))
        assert {o.data_ptr(), down.data_ptr(), decoder.lm_head.data_ptr()} <= own
        assert not {qkv.data_ptr(), bias.data_ptr(), gu.data_ptr()} & own
