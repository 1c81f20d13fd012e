"""The judge's own local engine: reward.judge.model served on loopback while a run
needs it, on the same sessionless OpenAI-compatible gateway `looprl serve` uses."""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator

from looprl.config import EngineConfig
from looprl.engines.local import LocalEngine
from looprl.gateway import GatewayServer, SessionStore, create_app
from looprl.models import load_tokenizer, model_config

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def serve_judge(model_path: str) -> AsyncIterator[tuple[str, str]]:
    """Serve `model_path` (a folder or 'default') at a loopback URL; yields (base_url,
    api_key) and stops the engine on exit."""
    engine = LocalEngine.from_config(model_path, EngineConfig())
    api_key = secrets.token_urlsafe(24)
    try:
        app = create_app(
            engine,
            load_tokenizer(model_path),
            model_name="judge",
            store=SessionStore(),
            sessionless=True,
            max_model_len=model_config(model_path).max_position_embeddings,
            sessionless_api_key=api_key,
        )
        async with GatewayServer(app, "127.0.0.1", 0) as server:
            log.info("The judge %s is served at %s/v1", model_path, server.url)
            yield f"{server.url}/v1", api_key
    finally:
        await engine.stop()
