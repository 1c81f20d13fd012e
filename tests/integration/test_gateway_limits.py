"""Hostile requests against a real gateway and engine: each gets a 4xx naming the field
and the limit, and never harms another session's request.

The first three tests are the regressions of issue 19's bugs: a top_k of 2**63 and a
temperature of 1e-40 (which failed every request in the engine's batch), and tool-call
arguments nesting a few thousand levels deep (a RecursionError, a 500).
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError

from looprl.config import LimitsConfig, SamplingConfig
from looprl.models import load_model, load_tokenizer
from tests.support.local_gateway import local_gateway

USER = [{"role": "user", "content": "What is 2 + 3?"}]
LIMITS = LimitsConfig(
    max_request_bytes=4096,  # room for the 3,000 characters of nested arguments
    max_json_depth=16,
    max_messages=4,
    max_stop_strings=2,
    max_stop_chars=8,
    request_token_budget=64,
)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


@pytest.fixture
async def server(tiny):
    model, tokenizer = tiny
    async with local_gateway(
        model,
        tokenizer,
        model_name="tiny",
        default_sampling=SamplingConfig(max_new_tokens=8),
        limits=LIMITS,
    ) as s:
        yield s


def _client(handle) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=handle.base_url, api_key=handle.api_key, max_retries=0)


async def test_top_k_of_2_pow_63_beside_another_session(server):
    """The huge top_k is served as no truncation; the other session's call is unharmed."""
    huge, other = server.open_session(), server.open_session()
    async with _client(huge) as a, _client(other) as b:
        plain = await a.chat.completions.create(model="m", messages=USER, seed=5)
        calls = [
            a.chat.completions.create(
                model="m", messages=USER, seed=5, extra_body={"top_k": 2**63}
            ),
            *(b.chat.completions.create(model="m", messages=USER, seed=i) for i in range(3)),
        ]
        results = await asyncio.gather(*calls)
    assert results[0].choices[0].token_ids == plain.choices[0].token_ids
    assert all(len(r.choices[0].token_ids) == 8 for r in results[1:])


async def test_tool_call_arguments_nested_thousands_deep_are_400(server):
    handle = server.open_session()
    deep = "[" * 1500 + "]" * 1500
    messages = [
        *USER,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
    ]
    async with _client(handle) as client:
        with pytest.raises(BadRequestError, match="deeper than 16") as raised:
            await client.chat.completions.create(model="m", messages=messages)
        assert raised.value.param == "messages[1].tool_calls[0].function.arguments"
        ok = await client.chat.completions.create(model="m", messages=USER)
    assert ok.choices[0].finish_reason in ("length", "stop")


async def test_temperature_1e_minus_40_with_logprobs_is_greedy(server):
    handle = server.open_session()
    async with _client(handle) as client:
        greedy = await client.chat.completions.create(
            model="m", messages=USER, temperature=0, logprobs=True
        )
        tiny_t = await client.chat.completions.create(
            model="m", messages=USER, temperature=1e-40, logprobs=True
        )
    assert tiny_t.choices[0].token_ids == greedy.choices[0].token_ids
    got = [t.logprob for t in tiny_t.choices[0].logprobs.content]
    assert all(math.isfinite(x) for x in got)
    assert got == pytest.approx([t.logprob for t in greedy.choices[0].logprobs.content])


async def _post(server, handle, body: bytes | dict, **headers) -> httpx.Response:
    url = f"{handle.base_url}/chat/completions"
    auth = {"Authorization": f"Bearer {handle.api_key}", **headers}
    async with httpx.AsyncClient(timeout=30) as http:
        if isinstance(body, dict):
            return await http.post(url, json=body, headers=auth)
        return await http.post(url, content=body, headers=auth)


async def test_body_over_the_size_limit_is_413_declared_or_streamed(server):
    handle = server.open_session()
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    declared = await _post(server, handle, big)
    assert declared.status_code == 413
    assert "gateway.limits.max_request_bytes" in declared.json()["error"]["message"]

    async def chunks():  # no content-length: the limit is counted as the body arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    streamed = await _post(server, handle, chunks())
    assert streamed.status_code == 413


async def test_json_nesting_in_the_body_is_400(server):
    handle = server.open_session()
    nested: dict = {"type": "object"}
    for _ in range(40):
        nested = {"type": "object", "properties": {"a": nested}}
    tool = {"type": "function", "function": {"name": "f", "parameters": nested}}
    r = await _post(server, handle, {"messages": USER, "tools": [tool]})
    assert r.status_code == 400
    assert "nests JSON deeper than 16" in r.json()["error"]["message"]
    # A string full of brackets is not nesting.
    r = await _post(server, handle, {"messages": [{"role": "user", "content": "[{" * 100}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"n": 9, "max_tokens": 8}, "n", "n=9 choices x max_tokens=8 = 72 tokens"),
        ({"max_tokens": 100}, "max_tokens", "at most 64"),
        ({"stop": ["a", "b", "c"]}, "stop", "3 strings; at most 2"),
        ({"stop": ["ok", "far too long"]}, "stop[1]", "12 characters"),
        ({"messages": USER * 5}, "messages", "5 messages; at most 4"),
        ({"temperature": -1}, "temperature", "greater than or equal to 0"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"seed": 2**64}, "seed", "less than"),
    ],
)
async def test_each_limit_names_its_field(server, body, param, message):
    handle = server.open_session()
    r = await _post(server, handle, {"messages": USER, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


async def test_nan_and_infinity_are_refused(server):
    handle = server.open_session()
    for raw in (
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
    ):
        r = await _post(server, handle, raw, **{"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] in ("temperature", "top_p")
