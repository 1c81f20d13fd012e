"""The engine and the trainer on one device (single process): the first train step's
peak resizes the engine's K/V budget. On a GPU the peak is the allocator's; here the
same code runs on the CPU with the byte counts given."""

import asyncio
from dataclasses import replace

import pytest

from looprl import startup
from looprl.config import load_config
from looprl.engines.base import EngineRequestError
from looprl.engines.local.engine import LocalEngine
from looprl.memory import HEADROOM, ModelSizes
from looprl.scheduling.single_process import resize_engine_kv
from looprl.types import SamplingParams

GIB = 2**30


def test_the_first_steps_peak_sets_the_engines_kv_budget(tiny_model_dir, tmp_path):
    cfg = load_config(
        None,
        [f"model.path={tiny_model_dir}", f"run.fileroot={tmp_path}", "engine.dtype=float32"],
    )
    setup = startup.start(cfg)
    # K and V x 2 layers x 2 K/V heads x 16 dims x 4 bytes = 512 bytes a token
    per_token = ModelSizes.of(setup.model.config).kv_bytes_per_token("float32")
    assert per_token == 512
    # start-up's plan as on a 1 GiB GPU (here, the CPU stands in for it)
    plan = replace(setup.memory, replan=True, device_bytes=GIB, kv_bytes_per_token=per_token)
    setup = replace(setup, memory=plan)
    model = setup.model.load().to(setup.device)
    engine = LocalEngine.for_model(model, setup.model.tokenizer, cfg.engine, setup.precision.engine)
    peak = int(GIB * HEADROOM) - 300 * 512  # leaves 300 tokens' worth under the headroom
    sampling = SamplingParams(max_new_tokens=20, temperature=0.0)

    async def run():
        await resize_engine_kv(engine, setup, peak)
        try:
            short = await engine.generate(list(range(1, 11)), sampling)
            assert len(short.output_ids) >= 1
            with pytest.raises(EngineRequestError, match="max_tokens_per_batch=300"):
                await engine.generate(list(range(1, 291)), sampling)  # 290 + 20 > 300
        finally:
            await engine.stop()

    asyncio.run(run())
