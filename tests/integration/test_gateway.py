"""The gateway over real HTTP on loopback, driven by the real `openai` client.

Every test runs a GatewayServer in its own event loop, in front of a real LocalEngine
on the tiny random-init model (SmolLM2's tokenizer and chat template), so the token
ids, logprobs and versions checked here are the ones the engine sampled.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from looprl.config import SamplingConfig
from looprl.engines.base import EngineUnavailable
from looprl.engines.local import LocalEngine
from looprl.gateway import GatewayServer, SessionHandle, SessionStore, create_app
from looprl.models import load_model, load_tokenizer
from looprl.rollout.trajectory import build_trajectories
from tests.support.local_gateway import local_gateway
from tests.support.serving import free_port, running_server

MAX_NEW_TOKENS = 6  # the run's default in these tests: short, so every call is fast


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


def _gateway(tiny, **app_kw):
    model, tokenizer = tiny
    defaults = {
        "model_name": "tiny",
        "default_sampling": SamplingConfig(max_new_tokens=MAX_NEW_TOKENS),
        "sessionless": True,
    }
    return local_gateway(model, tokenizer, **{**defaults, **app_kw})


@pytest.fixture
async def server(tiny) -> AsyncIterator[GatewayServer]:
    async with _gateway(tiny) as s:
        yield s


def _client(handle: SessionHandle) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=handle.base_url, api_key=handle.api_key, max_retries=0)


USER = [{"role": "user", "content": "What is 2 + 3?"}]


# ---- chat completions ----------------------------------------------------------------


async def test_chat_returns_logprobs_for_n_choices_and_records_each(server, tiny):
    _, tokenizer = tiny
    handle = server.open_session()
    async with _client(handle) as client:
        response = await client.chat.completions.create(
            model="gpt-4o-mini", messages=USER, n=2, logprobs=True, top_logprobs=3
        )
    assert response.model == "tiny"
    assert len(response.choices) == 2
    prompt_ids = response.prompt_token_ids
    assert prompt_ids == tokenizer.apply_chat_template(
        USER, add_generation_prompt=True, return_dict=False
    )
    session = server.store.get(handle.id)
    assert [it.completion_id for it in session.interactions] == [response.id] * 2
    for choice, recorded in zip(response.choices, session.interactions, strict=True):
        content = choice.logprobs.content
        assert choice.token_ids == recorded.output_ids
        assert len(content) == len(recorded.output_ids) == MAX_NEW_TOKENS
        assert choice.finish_reason == "length"
        assert recorded.prompt_ids == prompt_ids
        assert recorded.versions == [0] * MAX_NEW_TOKENS
        assert [c.logprob for c in content] == pytest.approx(recorded.logprobs)
        assert all(c.logprob <= 0 and len(c.top_logprobs) == 3 for c in content)
        assert [c.token for c in content] == tokenizer.batch_decode(
            [[i] for i in recorded.output_ids]
        )
        assert content[0].bytes == list(content[0].token.encode())
        assert choice.message.content == recorded.output_text
        assert recorded.output_text == tokenizer.decode(
            recorded.output_ids, skip_special_tokens=True
        )
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == 2 * MAX_NEW_TOKENS
    assert response.usage.total_tokens == len(prompt_ids) + 2 * MAX_NEW_TOKENS


async def test_sync_client_in_a_thread_streams_and_not(server):
    handle = server.open_session()
    client = OpenAI(base_url=handle.base_url, api_key=handle.api_key, max_retries=0)
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}],
        },
    ]

    def call_both() -> tuple:
        plain = client.chat.completions.create(model="m", messages=messages, max_tokens=3)
        chunks = list(
            client.chat.completions.create(
                model="m",
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                logprobs=True,
            )
        )
        return plain, chunks

    plain, chunks = await asyncio.to_thread(call_both)
    client.close()
    assert len(plain.choices[0].token_ids) == 3

    session = server.store.get(handle.id)
    first, second = session.interactions
    assert first.completion_id == plain.id and second.completion_id == chunks[0].id
    assert first.prompt_ids == second.prompt_ids  # both calls rendered the same messages
    assert chunks[0].prompt_token_ids == second.prompt_ids
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == second.output_text
    logprobs = [
        lp.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.content
    ]
    assert logprobs == pytest.approx(second.logprobs)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_NEW_TOKENS


async def test_async_stream_of_two_choices(server):
    handle = server.open_session()
    async with _client(handle) as client:
        stream = await client.chat.completions.create(
            model="m", messages=USER, n=2, stream=True, max_completion_tokens=4
        )
        chunks = [chunk async for chunk in stream]
    assert all(c.usage is None for c in chunks)  # include_usage not asked for
    texts = {0: "", 1: ""}
    finished = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length"}
    recorded = server.store.get(handle.id).interactions
    assert [it.output_text for it in recorded] == [texts[0], texts[1]]
    assert all(len(it.output_ids) == 4 for it in recorded)


async def test_seed_repeats_a_sample_and_stop_trims_the_text(server):
    handle = server.open_session()
    async with _client(handle) as client:
        a, b = [
            await client.chat.completions.create(model="m", messages=USER, seed=7, max_tokens=12)
            for _ in range(2)
        ]
        assert a.choices[0].token_ids == b.choices[0].token_ids
        text = a.choices[0].message.content
        stop = text[len(text) // 2 :][:3]
        cut = await client.chat.completions.create(
            model="m", messages=USER, seed=7, max_tokens=12, stop=[stop, "never-appears"]
        )
    assert stop and cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    recorded = server.store.get(handle.id).interactions[-1]
    assert recorded.output_text == cut.choices[0].message.content
    # the engine stops once the stop string is decoded; the sampled tokens are all kept
    assert recorded.output_ids == cut.choices[0].token_ids


async def test_64_concurrent_sessions_each_record_their_own_calls(server, tiny):
    _, tokenizer = tiny
    handles = [server.open_session() for _ in range(64)]
    markers = [f"session-{i}-{uuid.uuid4().hex[:8]}" for i in range(64)]

    async def run(handle: SessionHandle, marker: str) -> str:
        async with _client(handle) as client:
            response = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": marker}], max_tokens=3
            )
        return response.id

    ids = await asyncio.gather(*(run(h, m) for h, m in zip(handles, markers, strict=True)))
    assert len(set(ids)) == 64
    for handle, marker, completion_id in zip(handles, markers, ids, strict=True):
        session = server.close_session(handle.id)
        (interaction,) = session.interactions
        assert interaction.completion_id == completion_id
        assert marker in tokenizer.decode(interaction.prompt_ids)
        assert len(interaction.output_ids) == 3
    assert len(server.store) == 0


async def test_session_overrides_win_over_the_request(server):
    handle = server.open_session({"max_tokens": 2, "temperature": 0.0})
    async with _client(handle) as client:
        a, b = [
            await client.chat.completions.create(
                model="m", messages=USER, max_tokens=10, temperature=1.5
            )
            for _ in range(2)
        ]
    assert len(a.choices[0].token_ids) == 2
    assert a.choices[0].token_ids == b.choices[0].token_ids  # greedy
    with pytest.raises(ValueError, match="'max_new_tokens'"):
        server.open_session({"max_new_tokens": 2})
    with pytest.raises(ValueError, match="temperature"):
        server.open_session({"temperature": -1})


async def test_max_tokens_is_clamped_to_the_context_left(server):
    handle = server.open_session()
    async with _client(handle) as client:
        response = await client.completions.create(model="m", prompt=[42] * 1021, max_tokens=100)
    assert len(response.choices[0].token_ids) == 3
    assert response.choices[0].finish_reason == "length"


# ---- text completions ----------------------------------------------------------------


async def test_completions_with_token_ids_and_text(server, tiny):
    _, tokenizer = tiny
    handle = server.open_session()
    prompt_ids = tokenizer("The capital of France is").input_ids
    async with _client(handle) as client:
        by_ids = await client.completions.create(
            model="m", prompt=prompt_ids, max_tokens=5, logprobs=2
        )
        by_text = await client.completions.create(
            model="m", prompt="The capital of France is", max_tokens=5, stream=True
        )
        chunks = [c async for c in by_text]
    choice = by_ids.choices[0]
    assert by_ids.object == "text_completion" and by_ids.prompt_token_ids == prompt_ids
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == 5
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset[0] == 0
    first, second = server.store.get(handle.id).interactions
    assert first.prompt_ids == second.prompt_ids == prompt_ids
    assert first.logprobs == pytest.approx(choice.logprobs.token_logprobs)
    assert "".join(c.choices[0].text for c in chunks) == second.output_text


# ---- sessions, auth, rewards -----------------------------------------------------------


async def test_unknown_session_and_wrong_key_get_the_same_401(server):
    """A caller cannot tell an open session from one that does not exist."""
    handle = server.open_session()
    other = server.open_session()
    cases = {
        "wrong key": replace(handle, api_key="not-the-key"),
        "another session's key": replace(handle, api_key=other.api_key),
        "the session's reward key": replace(handle, api_key=handle.reward_key),
        "unknown session": replace(handle, id="nope", base_url=f"{server.url}/sessions/nope/v1"),
    }
    answers = {}
    async with httpx.AsyncClient() as http:
        for name, h in cases.items():
            auth = {"Authorization": f"Bearer {h.api_key}"}
            r = await http.post(
                f"{h.base_url}/chat/completions", json={"messages": USER}, headers=auth
            )
            answers[name] = (r.status_code, r.json())
        no_key = await http.post(f"{handle.base_url}/chat/completions", json={"messages": USER})
    answers["no key"] = (no_key.status_code, no_key.json())
    assert len({json.dumps(a, sort_keys=True) for a in answers.values()}) == 1, answers
    status, body = answers["unknown session"]
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert "not open" in body["error"]["message"] and "Bearer" in body["error"]["message"]

    async with _client(handle) as client:
        assert (await client.models.list()).data[0].id == "tiny"  # the right key works
    server.close_session(handle.id)
    async with _client(handle) as client:
        with pytest.raises(openai.AuthenticationError, match="not open"):
            await client.models.list()
    assert server.store.get(handle.id) is None


async def test_reward_in_all_three_shapes(server):
    handle = server.open_session()
    async with _client(handle) as client:
        ids = [
            (await client.chat.completions.create(model="m", messages=USER, max_tokens=2)).id
            for _ in range(2)
        ]
    url = f"{server.url}/sessions/{handle.id}/reward"
    headers = {"Authorization": f"Bearer {handle.reward_key}"}
    session = server.store.get(handle.id)
    async with httpx.AsyncClient(headers=headers) as http:
        # the model-call key posts no reward: code the model drives may hold it
        model_key = {"Authorization": f"Bearer {handle.api_key}"}
        refused = await http.post(url, json={"reward": 1}, headers=model_key)
        assert refused.status_code == 401 and "reward_key" in refused.json()["error"]["message"]
        assert session.reward is None
        assert (await http.post(url, json={"reward": 0.5})).json()["reward"] == 0.5
        assert session.reward == 0.5
        assert (await http.post(url, json={"rewards": {ids[0]: 1.0}})).status_code == 200
        assert (
            await http.post(url, json={"completion_id": ids[1], "reward": -1})
        ).status_code == 200
        assert session.reward == {ids[0]: 1.0, ids[1]: -1.0}

        bad = {
            "unknown id": {"completion_id": "chatcmpl-x", "reward": 1},
            "no reward": {},
            "both shapes": {"reward": 1, "rewards": {ids[0]: 1}},
            "not a number": {"reward": "high"},
        }
        for case, body in bad.items():
            response = await http.post(url, json=body)
            assert response.status_code == 400, case
            assert response.json()["error"]["message"], case
        nan = await http.post(
            url, content=b'{"reward": NaN}', headers={"content-type": "application/json"}
        )
        assert nan.status_code == 400 and nan.json()["error"]["param"] == "reward"
        wrong_key = await http.post(url, json={"reward": 1}, headers={"Authorization": "Bearer x"})
        assert wrong_key.status_code == 401
    assert session.reward == {ids[0]: 1.0, ids[1]: -1.0}

    session = server.close_session(handle.id)
    # what the controller exports: the posted per-call rewards, one sample per call
    trajectories, _, _ = build_trajectories(
        session.interactions, session.reward, session_id=session.id
    )
    assert [t.reward for t in trajectories] == [1.0, -1.0]
    assert all(t.num_sampled_tokens == 2 and t.session_id == handle.id for t in trajectories)
    trajectories, _, _ = build_trajectories(session.interactions, 2.0, "per_call")
    assert [t.reward for t in trajectories] == [2.0, 2.0]


# ---- bad requests ----------------------------------------------------------------------


BAD_CHAT = {
    "missing messages": ({"model": "m"}, "messages"),
    "empty messages": ({"messages": []}, "messages"),
    "temperature < 0": ({"messages": USER, "temperature": -1}, "temperature"),
    "n = 0": ({"messages": USER, "n": 0}, "n"),
    "n too large": ({"messages": USER, "n": 100_000}, "n"),
    "max_tokens = 0": ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    "max_tokens not a number": ({"messages": USER, "max_tokens": "many"}, "max_tokens"),
    "top_p = 0": ({"messages": USER, "top_p": 0}, "top_p"),
    "top_logprobs > 20": ({"messages": USER, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    "empty stop string": ({"messages": USER, "stop": [""]}, "stop[0]"),
    "stop not a string": ({"messages": USER, "stop": 5}, "stop"),
    "unknown role": ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    "content not text": ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    "image part": (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
    ),
    "messages not a list": ({"messages": "hi"}, "messages"),
    "huge prompt": ({"messages": [{"role": "user", "content": "hello " * 2000}]}, "messages"),
    "seed negative": ({"messages": USER, "seed": -1}, "seed"),
}


async def test_bad_requests_get_400_naming_the_field_and_the_server_keeps_serving(server):
    handle = server.open_session()
    headers = {"Authorization": f"Bearer {handle.api_key}"}
    async with httpx.AsyncClient(base_url=handle.base_url, headers=headers) as http:
        for case, (body, param) in BAD_CHAT.items():
            response = await http.post("/chat/completions", json=body)
            assert response.status_code == 400, (case, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error", case
            assert error["param"] == param, (case, error)
            assert error["message"].startswith(param), (case, error)

        raw = {
            "invalid JSON": b'{"messages": [',
            "empty body": b"",
            "JSON list": b"[1, 2]",
            "binary": b"\xff\xfe\x00",
        }
        for case, content in raw.items():
            response = await http.post(
                "/chat/completions", content=content, headers={"content-type": "application/json"}
            )
            assert response.status_code == 400, (case, response.text)
            assert response.json()["error"]["message"], case

        bad_ids = await http.post("/completions", json={"prompt": [1, 10**9]})
        assert bad_ids.status_code == 400 and bad_ids.json()["error"]["param"] == "prompt[1]"
        negative = await http.post("/completions", json={"prompt": [1, -1]})
        assert negative.json()["error"]["param"] == "prompt[1]"
        empty = await http.post("/completions", json={"prompt": ""})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt"
        missing_route = await http.post("/embeddings", json={})
        assert missing_route.status_code == 404 and "error" in missing_route.json()

        ok = await http.post("/chat/completions", json={"messages": USER, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    assert len(server.store.get(handle.id).interactions) == 1


async def test_engine_refusal_is_400_and_a_stopped_engine_503(tiny):
    """A request the engine cannot serve is the request's fault (400, the engine's reason);
    an engine that cannot serve anything is not (503)."""
    model, tokenizer = tiny
    engine = LocalEngine(
        model, eos_token_ids=[tokenizer.eos_token_id], decode=tokenizer.decode, dtype="float32"
    )
    app = create_app(  # no max_model_len: too-long prompts reach the engine
        engine,
        tokenizer,
        model_name="tiny",
        store=SessionStore(),
        default_sampling=SamplingConfig(max_new_tokens=MAX_NEW_TOKENS),
    )
    async with GatewayServer(app) as server:
        handle = server.open_session()
        async with _client(handle) as client:
            with pytest.raises(openai.BadRequestError, match="max_position_embeddings"):
                await client.completions.create(model="m", prompt=[42] * 1024)
            stream = await client.completions.create(
                model="m", prompt=[42] * 1024, stream=True, n=2
            )
            with pytest.raises(openai.APIError, match="max_position_embeddings"):
                _ = [c async for c in stream]
            ok = await client.completions.create(model="m", prompt=[42] * 8)
            assert len(ok.choices[0].token_ids) == MAX_NEW_TOKENS
            assert len(server.store.get(handle.id).interactions) == 1
            # A LocalEngine restarts on the next call; one whose process died would not.
            await engine.stop()
            engine.generate = _dead_engine
            with pytest.raises(openai.InternalServerError, match="stopped") as raised:
                await client.completions.create(model="m", prompt=[42] * 8)
            assert raised.value.status_code == 503


async def _dead_engine(*args, **kwargs):
    raise EngineUnavailable("the engine's process stopped")


# ---- sessionless serving -------------------------------------------------------------


async def test_plain_v1_needs_no_key_and_records_nothing(server):
    async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="anything") as client:
        models = await client.models.list()
        response = await client.chat.completions.create(model="whatever", messages=USER)
    assert [m.id for m in models.data] == ["tiny"]
    assert len(response.choices[0].token_ids) == MAX_NEW_TOKENS
    async with httpx.AsyncClient() as http:
        health = (await http.get(f"{server.url}/health")).json()
    assert health == {"status": "ok", "model": "tiny", "open_sessions": 0, "tool_call_errors": 0}


async def test_sessions_only_without_sessionless(tiny):
    async with _gateway(tiny, sessionless=False) as server:
        async with httpx.AsyncClient() as http:
            response = await http.post(f"{server.url}/v1/chat/completions", json={"messages": USER})
        assert response.status_code == 404


async def _until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"waited {timeout_s} s for {what}"
        await asyncio.sleep(0.01)


async def test_a_call_stops_when_its_session_closes_or_its_client_leaves(server):
    engine = server.app.state.engine
    handle = server.open_session()
    async with _client(handle) as client:
        long_call = asyncio.create_task(
            client.chat.completions.create(model="m", messages=USER, max_tokens=900)
        )
        await _until(lambda: engine._rows, "the call to be generating")
        server.close_session(handle.id)
        with pytest.raises(openai.NotFoundError, match="closed while this call was generating"):
            await long_call
    assert server.store.get(handle.id) is None

    handle = server.open_session()
    async with _client(handle) as client:

        async def agent_call(stream: bool) -> None:
            response = await client.chat.completions.create(
                model="m", messages=USER, max_tokens=900, stream=stream
            )
            if stream:
                _ = [chunk async for chunk in response]

        for stream in (False, True):  # a rollout timing out cancels its agent like this
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(agent_call(stream), timeout=0.3)
        # The gateway notices the client left and the engine drops the generation.
        await _until(lambda: not engine._rows and not engine._waiting, "the engine to be idle")
        ok = await client.chat.completions.create(model="m", messages=USER, max_tokens=2)
    assert [it.completion_id for it in server.store.get(handle.id).interactions] == [ok.id]


async def test_an_idle_connection_stays_open_longer_than_clients_keep_one(server):
    # httpx (the openai client) reuses a connection idle for up to 5 s; the gateway keeps
    # one open longer, so a call on a reused connection never meets the gateway closing
    # it. One HTTP/1.1 connection, a request, 6 s idle, a second request on it.
    reader, writer = await asyncio.open_connection(server.host, server.port)
    request = f"GET /health HTTP/1.1\r\nHost: {server.host}\r\n\r\n".encode()
    for first in (True, False):
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200"), head
        length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE).group(1))
        await reader.readexactly(length)
        if first:
            await asyncio.sleep(6)
            assert not reader.at_eof(), "the gateway closed an idle connection within 6 s"
    writer.close()


def test_serve_runs_sessionless_until_sigint(tiny_model_dir):
    port = free_port()
    code = (
        "from looprl.commands.serve import serve_model; "
        f"serve_model({str(tiny_model_dir)!r}, port={port})"
    )
    with running_server([sys.executable, "-c", code], port) as health:
        assert health["model"] == tiny_model_dir.name
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        response = client.chat.completions.create(model="x", messages=USER, max_tokens=2)
        assert len(response.choices[0].token_ids) == 2


def test_serve_with_a_key_refuses_calls_without_it(tiny_model_dir):
    port = free_port()
    cmd = [sys.executable, "-m", "looprl.cli", "serve", "--model", str(tiny_model_dir)]
    cmd += ["--port", str(port)]
    env = {**os.environ, "LOOPRL_API_KEY": "k3y"}
    with running_server(cmd, port, env=env):
        base = f"http://127.0.0.1:{port}/v1"
        for wrong in ("none", "k3y-not"):
            client = OpenAI(base_url=base, api_key=wrong, max_retries=0)
            with pytest.raises(openai.AuthenticationError, match="--api-key"):
                client.chat.completions.create(model="x", messages=USER, max_tokens=2)
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        client = OpenAI(base_url=base, api_key="k3y", max_retries=0)
        response = client.chat.completions.create(model="x", messages=USER, max_tokens=2)
        assert len(response.choices[0].token_ids) == 2


def test_serve_on_another_address_needs_a_key_or_no_auth(tiny_model_dir):
    cmd = [sys.executable, "-m", "looprl.cli", "serve", "--model", str(tiny_model_dir)]
    env = {k: v for k, v in os.environ.items() if k != "LOOPRL_API_KEY"}
    refused = subprocess.run(
        [*cmd, "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120, env=env
    )
    assert refused.returncode == 2
    said = refused.stderr.replace("\n", " ")
    assert "--api-key" in said and "--no-auth" in said and "Traceback" not in said
