"""Fixtures of the gpu tests: the device they run on, and a tiny random Llama.

Every test here takes its device from `device` and runs the same code on the CPU
(LOOPRL_GPU_TESTS_ON=cpu) as on the GPU; none needs the default model or a tokenizer,
so `make test-gpu` runs with nothing but the carried wheels (docs/gpu.md).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.gpu.device import device_for_tests
from tests.support.architectures import SIZES

VOCAB = 1024  # above tests/support/batches.py's random token ids, [3, 1000)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """cuda:0, or the CPU under LOOPRL_GPU_TESTS_ON=cpu (tests/gpu/device.py)."""
    return device_for_tests()


def tiny_llama(seed: int) -> LlamaForCausalLM:
    """A 2-layer random Llama (grouped-query attention, untied head) in float32 on the
    CPU, initialized at tests/support/architectures.py's larger scale so that greedy
    decoding does not just repeat a token. Its generation config has no EOS, so Hugging
    Face's `generate` makes exactly the tokens asked for, as an engine without
    eos_token_ids does."""
    config = LlamaConfig(
        **SIZES | dict(vocab_size=VOCAB, max_position_embeddings=256),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Eight prompts of 3-17 random token ids (so a batch is ragged)."""
    gen = torch.Generator().manual_seed(0)
    lengths = (3, 17, 8, 11, 5, 14, 9, 6)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]
