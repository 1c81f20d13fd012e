"""check_placement: engine launch options against the GPUs a machine has."""

from __future__ import annotations

import pytest

from looprl.config import EngineConfig
from looprl.engines.base import EngineError
from looprl.engines.launch import check_placement


@pytest.mark.parametrize(
    ("options", "gpus", "expected"),
    [
        ({"type": "vllm", "tensor_parallel_size": 2}, 0, "tensor_parallel_size=2 shards"),
        ({"type": "vllm", "tensor_parallel_size": 8}, 4, "needs 8 GPUs, and this machine has 4"),
        ({"type": "vllm", "gpu_memory_fraction": 0.9}, 0, "no GPU visible; on CPU the vLLM KV"),
        (
            {"type": "vllm", "gpu_memory_fraction": 0.9, "kv_cache_gib": 20},
            1,
            "both size vLLM's KV cache on GPUs; set one of them",
        ),
        (
            {"type": "sglang"},
            0,
            "engine.type=sglang launches an SGLang server, which needs a CUDA GPU",
        ),
        (
            {"type": "sglang", "tensor_parallel_size": 4},
            2,
            "tensor_parallel_size=4 needs 4 GPUs.*has 2",
        ),
    ],
)
def test_options_the_machine_cannot_honor_are_refused(options, gpus, expected):
    with pytest.raises(EngineError, match=expected):
        check_placement(EngineConfig(**options), gpus)


@pytest.mark.parametrize(
    ("options", "gpus"),
    [
        ({"type": "local"}, 0),
        ({"type": "vllm", "kv_cache_gib": 2}, 0),  # vLLM-CPU
        ({"type": "vllm", "tensor_parallel_size": 4, "gpu_memory_fraction": 0.8}, 4),
        ({"type": "sglang", "url": "http://10.0.0.5:30000"}, 0),  # placed where it runs
    ],
)
def test_options_the_machine_can_honor_pass(options, gpus):
    check_placement(EngineConfig(**options), gpus)
