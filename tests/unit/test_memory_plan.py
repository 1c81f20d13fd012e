"""The memory plan of one GPU (looprl/memory.py): hand-computed budgets from made-up
device sizes, so every branch runs on this CPU."""

import pytest

from looprl.memory import ModelSizes, kv_tokens_after_step
from looprl.models import load_model
from tests.support.memory_plans import GIB, plan_for

# 1M parameters; 2 layers of hidden 64, MLP 256, 4 heads (2 K/V heads) of 16; 1000 tokens.
SMALL = ModelSizes(
    params=1_000_000,
    layers=2,
    hidden=64,
    intermediate=256,
    heads=4,
    kv_heads=2,
    head_dim=16,
    vocab=1000,
)


def _plan(**overrides):
    return plan_for(SMALL, **overrides)


def test_per_token_sizes():
    # K and V x 2 layers x 2 heads x 16 dims x 2 bytes
    assert SMALL.kv_bytes_per_token("bfloat16") == 256
    assert SMALL.kv_bytes_per_token("float32") == 512
    # per layer (8 x 64 + 4 x 256) x 2 bytes = 3072, x 2 layers, + 1000 x (4 + 4 + 2)
    assert SMALL.train_bytes_per_token("bfloat16", checkpointing=False) == 16144
    # checkpointing: each layer's input (64 x 2 x 2 layers) + one layer + the logits
    assert SMALL.train_bytes_per_token("bfloat16", checkpointing=True) == 256 + 3072 + 10000


def test_the_trainer_takes_half_of_what_is_left_and_the_engine_the_rest():
    decided = _plan()
    # usable: 0.9 x 1 GiB = 966367641; fixed: 1M x (4 + 4 + 8) + 1M x 2 (autocast copies)
    # + 2 x 1M x 2 (engine copy and fused weights) = 22e6; left 944367641.
    # train: 944367641 / 2 // 16144 = 29248, rounded down to 256s: 29184
    assert decided.train_tokens_per_mb == 29184
    # K/V: 944367641 - 29184 x 16144 = 473221145 bytes // 256 per token
    assert decided.engine_kv_tokens == 1848520
    assert decided.replan and "cuda:0" in decided.describe()
    assert (decided.device_bytes, decided.kv_bytes_per_token) == (GIB, 256)  # for the resize
    assert _plan(engine_cap=65536).engine_kv_tokens == 65536
    # a micro-batch never passes MAX_TOKENS_PER_MB, however much memory
    assert _plan(total=100 * GIB, free=100 * GIB).train_tokens_per_mb == 32768


def test_settings_given_are_kept():
    decided = _plan(train_tokens=1024, engine_fraction=0.25)
    assert decided.train_tokens_per_mb == 1024
    # 0.25 x 1 GiB - 4e6 of engine weights = 264435456 bytes // 256
    assert decided.engine_kv_tokens == 1032951
    assert not decided.replan  # the user's fraction stands; nothing is measured
    assert "engine.memory_fraction=0.25" in decided.reason


def test_without_the_engine_or_the_trainer_on_the_device():
    # vLLM elsewhere: the trainer gets all that is left; 948367641 // 16144 -> 58624, capped
    alone = _plan(engine_dtype=None, total=GIB // 2 + 30_000_000, free=GIB // 2 + 30_000_000)
    # usable 0.9 x 566870912 = 510183820; fixed 18e6; left 492183820 // 16144 = 30487 -> 30464
    assert alone.train_tokens_per_mb == 30464 and not alone.replan
    # rollout only: no trainer, the engine takes what the weights leave: 962367641 // 256
    assert _plan(train=False).engine_kv_tokens == 3759248


def test_lora_and_frozen_copies_change_the_fixed_costs():
    # LoRA: the frozen base in bf16 (2e6) + engine 4e6; left 960367641 / 2 // 16144 -> 29696
    assert _plan(lora=True).train_tokens_per_mb == 29696
    # a KL reference in float32 adds 4e6: left 940367641 / 2 // 16144 = 29124 -> 28928
    assert _plan(extra_models=1).train_tokens_per_mb == 28928


def test_what_does_not_fit_fails_naming_the_settings():
    with pytest.raises(ValueError, match="the model does not fit cuda:0"):
        _plan(free=GIB // 10 + 10_000_000)  # usable 10 MB, fixed 22 MB
    with pytest.raises(ValueError, match="lower train.max_tokens_per_mb"):
        _plan(train_tokens=58497)  # 58497 x 16144 bytes > the 944367641 left


def test_the_first_step_resizes_the_engine_cache():
    # 0.9 GiB usable, less (600e6 - 100e6) held besides the K/V: 466367641 // 256
    assert (
        kv_tokens_after_step(
            total=GIB,
            peak=600_000_000,
            engine_kv_bytes=100_000_000,
            kv_bytes_per_token=256,
            cap=10**7,
        )
        == 1821748
    )
    assert (
        kv_tokens_after_step(
            total=GIB, peak=600_000_000, engine_kv_bytes=0, kv_bytes_per_token=256, cap=65536
        )
        == 65536
    )
    # a peak past the headroom leaves the least budget, never a negative one
    assert (
        kv_tokens_after_step(
            total=GIB, peak=GIB, engine_kv_bytes=0, kv_bytes_per_token=256, cap=10**7
        )
        == 256
    )


def test_sizes_are_counted_from_the_config(tiny_model_dir):
    model = load_model(tiny_model_dir)
    sizes = ModelSizes.of(model.config)
    assert sizes.params == sum(p.numel() for p in model.parameters())
    cfg = model.config
    assert (sizes.layers, sizes.hidden, sizes.vocab) == (
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.vocab_size,
    )
    assert sizes.kv_heads == cfg.num_key_value_heads
