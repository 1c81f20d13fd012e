"""A memory plan (looprl/memory.py) with the settings a bf16-autocast run with a local
engine on a 1 GiB GPU would pass; a test overrides what it is about."""

from __future__ import annotations

from looprl.memory import MemoryPlan, ModelSizes, plan

GIB = 2**30


def plan_for(sizes: ModelSizes, **overrides) -> MemoryPlan:
    settings = dict(
        total=GIB,
        free=GIB,
        sizes=sizes,
        master="float32",
        compute="bfloat16",
        autocast=True,
        lora=False,
        extra_models=0,
        engine_dtype="bfloat16",
        checkpointing=False,
        train_tokens=None,
        engine_cap=10**7,
        engine_fraction=None,
        device="cuda:0",
    )
    return plan(**{**settings, **overrides})
