"""A gateway on loopback in front of a LocalEngine, both in this test's event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from looprl.config import SamplingConfig
from looprl.engines.local.engine import LocalEngine
from looprl.gateway import GatewayServer, SessionStore, create_app
from looprl.models import load_model, load_tokenizer


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
    app.state.engine = engine  # for tests that wait on what the engine is doing
    try:
        async with GatewayServer(app) as server:
            yield server
    finally:
        await engine.stop()


class ThreadedGateway:
    """`local_gateway` on an event loop in a thread of its own, for synchronous clients
    (schemathesis, requests). `call(fn)` runs `fn(server)` on that loop."""

    def __init__(self, model, tokenizer, **app_kw) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._context = local_gateway(model, tokenizer, **app_kw)
        self.server: GatewayServer = self._run(self._context.__aenter__())

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=120)

    def call(self, fn):
        async def on_loop():
            return fn(self.server)

        return self._run(on_loop())

    def close(self) -> None:
        self._run(self._context.__aexit__(None, None, None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


def greedy_gateway(model_dir):
    """`local_gateway` on the model in `model_dir`, served as "calc", sampling greedily
    (40 new tokens: a tool call and its arguments)."""
    return local_gateway(
        load_model(model_dir),
        load_tokenizer(model_dir),
        model_name="calc",
        default_sampling=SamplingConfig(temperature=0, max_new_tokens=40),
    )
