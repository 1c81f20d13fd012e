"""The judge's own local engine: reward.judge.model served on loopback while a run
needs it, on the same sessionless OpenAI-compatible gateway `looprl serve` uses."""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from looprl.gateway import serve_sessionless

if TYPE_CHECKING:
    from looprl.startup import LocalModel

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def serve_judge(judge: LocalModel) -> AsyncIterator[tuple[str, str]]:
    """Serve `judge` (the model and engine precision start-up resolved) at a loopback
    URL with a key of its own; yields (base_url, api_key) and stops the engine on exit."""
    engine = judge.engine()
    api_key = secrets.token_urlsafe(24)
    try:
        async with serve_sessionless(
            engine,
            judge.files.tokenizer,
            model_name="judge",
            max_model_len=judge.files.context_length,
            api_key=api_key,
        ) as server:
            log.info("The judge %s is served at %s/v1", judge.files.name, server.url)
            yield f"{server.url}/v1", api_key
    finally:
        await engine.stop()
