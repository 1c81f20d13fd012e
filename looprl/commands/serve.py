"""`looprl serve`: one model on plain OpenAI-compatible endpoints, for any agent or tool.

The local engine behind a sessionless gateway (`/v1/chat/completions`,
`/v1/completions`, `/v1/models`; no sessions), until Ctrl-C or SIGTERM, after which
requests in flight finish. With `api_key` every /v1 call needs it; on an address other
than loopback one is required (or `no_auth`, said explicitly).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

from looprl import startup
from looprl.config import EngineConfig
from looprl.gateway.server import is_loopback, serve_sessionless
from looprl.models import DEFAULT_MODEL, DEFAULT_MODEL_NAME

log = logging.getLogger(__name__)


def serve_model(
    model_path: str = DEFAULT_MODEL,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "auto",
    model_name: str | None = None,
    api_key: str | None = None,
    no_auth: bool = False,
    device: str = "auto",
) -> None:
    """Serve a model at `http://host:port/v1` (no sessions) until Ctrl-C or SIGTERM.

    `model_name` is what /v1/models reports; by default the model folder's name.
    Raises ValueError, before loading anything, for a non-loopback `host` with neither
    `api_key` nor `no_auth`.
    """
    if api_key is None and not no_auth and not is_loopback(host):
        raise ValueError(
            f"--host {host} lets other machines reach the server: give it a key "
            "(--api-key KEY, or LOOPRL_API_KEY) that clients send as `Authorization: "
            "Bearer KEY`, or pass --no-auth if anyone who can reach it may use it"
        )
    asyncio.run(_serve_model(model_path, host, port, dtype, device, model_name, api_key))


async def _serve_model(
    model_path: str,
    host: str,
    port: int,
    dtype: str,
    device: str,
    model_name: str | None,
    api_key: str | None,
) -> None:
    if model_name is None:
        model_name = DEFAULT_MODEL_NAME if model_path == DEFAULT_MODEL else Path(model_path).name
    local = startup.serve_on_local_engine(model_path, EngineConfig(dtype=dtype), device)
    engine = local.engine()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with serve_sessionless(
            engine,
            local.files.tokenizer,
            model_name=model_name,
            max_model_len=local.files.context_length,
            host=host,
            port=port,
            api_key=api_key,
        ) as server:
            log.info(
                "Serving %s at %s/v1 (any model name is accepted); Ctrl-C stops",
                model_name,
                server.url,
            )
            await stop.wait()
            log.info("Stopping: letting requests in flight finish")
    finally:
        await engine.stop()
