"""A gateway on loopback in front of a LocalEngine, both in this test's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from looprl.engines.local.engine import LocalEngine
from looprl.gateway import GatewayServer, SessionStore, create_app


@asynccontextmanager
async def local_gateway(model, tokenizer, **app_kw) -> AsyncIterator[GatewayServer]:
    """`create_app(**app_kw)` served on a free port; the model's context is the default
    `max_model_len`. The engine (float32: a seeded sample repeats exactly; in bfloat16 a
    prefix reused from the store can round differently and flip a near-tie) stops when
    the block ends."""
    engine = LocalEngine(
        model, eos_token_ids=[tokenizer.eos_token_id], decode=tokenizer.decode, dtype="float32"
    )
    app_kw = {"max_model_len": model.config.max_position_embeddings, **app_kw}
    app = create_app(engine, tokenizer, store=SessionStore(), **app_kw)
    try:
        async with GatewayServer(app) as server:
            yield server
    finally:
        await engine.stop()
