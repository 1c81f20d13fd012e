"""A streamed call stops generating, in the engine and not only in the response, when its
session closes or its client leaves: over chat completions, the Responses API and
Anthropic's Messages API, with the real `openai` and `anthropic` clients on loopback.

Issue 51: a Responses stream went on generating for 193 s after its session was closed
(the non-streamed call answered 404 in 0.25 s). Each test catches the engine's row for
the call, stops the call half-way, and asserts the row leaves the batch within
STOP_WITHIN_S, cut short (no finish reason, fewer tokens than asked), and that nothing
is recorded on the session.
"""

from __future__ import annotations

import asyncio

import anthropic
import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from looprl.config import SamplingConfig
from looprl.models import load_model, load_tokenizer
from tests.support.local_gateway import local_gateway

MAX_TOKENS = 900  # the tiny model's context is 1,024: ~ seconds of decoding on 2 cores
STOP_WITHIN_S = 2.0  # the gateway checks every 0.25 s; the engine drops a row at its next step
USER = [{"role": "user", "content": "Count to a thousand."}]
SEED = {"seed": 3}  # a draw that never samples the end of text within MAX_TOKENS


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


@pytest.fixture
async def server(tiny):
    model, tokenizer = tiny
    sampling = SamplingConfig(max_new_tokens=MAX_TOKENS)
    async with local_gateway(model, tokenizer, model_name="tiny", default_sampling=sampling) as s:
        yield s


async def _stream_chat(handle) -> list:
    async with AsyncOpenAI(base_url=handle.base_url, api_key=handle.api_key, max_retries=0) as c:
        stream = await c.chat.completions.create(
            model="m", messages=USER, max_tokens=MAX_TOKENS, stream=True, seed=SEED["seed"]
        )
        return [chunk async for chunk in stream]


async def _stream_responses(handle) -> list:
    async with AsyncOpenAI(base_url=handle.base_url, api_key=handle.api_key, max_retries=0) as c:
        stream = await c.responses.create(
            model="m",
            input="Count to a thousand.",
            max_output_tokens=MAX_TOKENS,
            stream=True,
            extra_body=SEED,
        )
        return [event async for event in stream]


async def _stream_messages(handle) -> list:
    root = handle.base_url.removesuffix("/v1")
    async with AsyncAnthropic(base_url=root, api_key=handle.api_key, max_retries=0) as c:
        stream = await c.messages.create(
            model="m", messages=USER, max_tokens=MAX_TOKENS, stream=True, extra_body=SEED
        )
        return [event async for event in stream]


STREAMS = {"chat": _stream_chat, "responses": _stream_responses, "messages": _stream_messages}


async def _until(condition, what: str, timeout_s: float) -> float:
    """Seconds until `condition()` holds; fails after `timeout_s`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not condition():
        assert loop.time() - start < timeout_s, f"waited {timeout_s} s for {what}"
        await asyncio.sleep(0.01)
    return loop.time() - start


async def _stop_half_way(server, api: str, stop) -> tuple[asyncio.Task, float]:
    """Start `api`'s stream, wait until the engine has decoded a few tokens of it, call
    `stop(handle, task)`; the task and how long the engine took to drop the row."""
    engine = server.app.state.engine
    handle = server.open_session()
    task = asyncio.create_task(STREAMS[api](handle))
    await _until(lambda: engine._rows, "the stream to be generating", timeout_s=60)
    row = engine._rows[0]
    await _until(lambda: len(row.output_ids) >= 8, "a few tokens", timeout_s=60)
    stop(handle, task)
    stopped_s = await _until(lambda: not engine._rows, "the engine to drop the row", 30)
    assert row.finish_reason is None, row.finish_reason  # dropped, not finished
    assert len(row.output_ids) < MAX_TOKENS - 100, len(row.output_ids)
    assert stopped_s < STOP_WITHIN_S, stopped_s
    print(f"{api}: the engine dropped the row {stopped_s:.2f} s after the stop")
    return task, stopped_s


@pytest.mark.parametrize("api", sorted(STREAMS))
async def test_a_stream_stops_generating_when_its_session_closes(server, api):
    task, _ = await _stop_half_way(server, api, lambda handle, _: server.close_session(handle.id))
    if api == "responses":  # the stream's last event is the error
        events = await task
        assert events[-1].type == "error" and events[-1].code == "not_found_error", events[-1]
        assert "was closed" in events[-1].message, events[-1]
    elif api == "messages":
        with pytest.raises(anthropic.APIStatusError, match="was closed.*not_found_error"):
            await task
    else:
        with pytest.raises(Exception, match="was closed"):  # openai.APIError mid-stream
            await task


@pytest.mark.parametrize("api", sorted(STREAMS))
async def test_a_stream_stops_generating_when_its_client_leaves(server, api):
    handle_box = {}

    def leave(handle, task):
        handle_box["handle"] = handle
        task.cancel()  # as a rollout's timeout cancels its agent

    task, _ = await _stop_half_way(server, api, leave)
    with pytest.raises(asyncio.CancelledError):
        await task
    session = server.store.get(handle_box["handle"].id)
    assert session.interactions == []  # nothing was answered, so nothing is recorded
