"""EnginePool over real LocalEngines (and a real SGLang-protocol server on loopback).

Routing is checked by hand: with the pool paused, requests queue on their replica
without running, so each one's outstanding tokens (prompt + max_new_tokens) stay put
and the choice of the next request can be computed. Failures are real: a replica's
`stop()` while it decodes, a server that is gone.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from openai import AsyncOpenAI

from looprl.config import EngineConfig, SamplingConfig
from looprl.engines import pool as pool_module
from looprl.engines.base import EngineError, EngineUnavailable
from looprl.engines.local.engine import LocalEngine
from looprl.engines.pool import EnginePool
from looprl.engines.servers.sglang import SGLangEngine
from looprl.gateway import GatewayServer, SessionStore, create_app
from looprl.models import load_model, load_tokenizer
from looprl.types import SamplingParams
from tests.support.sglang_protocol import sglang_protocol_server

PROMPT = list(range(100, 110))  # 10 tokens: a request's cost is 10 + max_new_tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def local_engine(model, tokenizer) -> LocalEngine:
    """No EOS: every generation runs to max_new_tokens, so lengths are known."""
    return LocalEngine(model, eos_token_ids=[], decode=tokenizer.decode)


@pytest.fixture
async def engines(model, tokenizer):
    engines = [local_engine(model, tokenizer), local_engine(model, tokenizer)]
    yield engines
    for engine in engines:
        await engine.stop()


@pytest.fixture
def pool(engines) -> EnginePool:
    return EnginePool(engines, names=["a", "b"])


def tokens(pool: EnginePool) -> dict[str, int]:
    return {name: r["outstanding_tokens"] for name, r in pool.stats()["replicas"].items()}


def served(pool: EnginePool) -> dict[str, int]:
    return {name: r["served"] for name, r in pool.stats()["replicas"].items()}


async def dispatch(pool: EnginePool, max_new_tokens: int, session: str | None = None):
    """Start a request and let it reach its replica (where it waits while paused)."""
    task = asyncio.create_task(
        pool.generate(PROMPT, SamplingParams(max_new_tokens), session=session)
    )
    await asyncio.sleep(0)
    return task


async def until(condition, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.002)


def decoding(engine: LocalEngine, rows: int) -> bool:
    """`engine` has `rows` requests in its batch, each with a token sampled."""
    return len(engine._rows) == rows and all(r.output_ids for r in engine._rows)


async def test_a_request_goes_to_the_replica_with_fewest_outstanding_tokens(pool):
    await pool.pause()
    tasks = [await dispatch(pool, 50)]  # idle: a (first of the tie) holds 10 + 50
    assert tokens(pool) == {"a": 60, "b": 0}
    tasks.append(await dispatch(pool, 20))  # 0 < 60: b
    assert tokens(pool) == {"a": 60, "b": 30}
    tasks.append(await dispatch(pool, 10))  # 30 < 60: b
    assert tokens(pool) == {"a": 60, "b": 50}
    tasks.append(await dispatch(pool, 5))  # 50 < 60: b
    assert tokens(pool) == {"a": 60, "b": 65}
    tasks.append(await dispatch(pool, 1))  # 60 < 65: a
    assert tokens(pool) == {"a": 71, "b": 65}
    await pool.resume()
    gens = await asyncio.gather(*tasks)
    assert [len(g.output_ids) for g in gens] == [50, 20, 10, 5, 1]
    assert served(pool) == {"a": 2, "b": 3} and tokens(pool) == {"a": 0, "b": 0}
    # Idle again: the tie on tokens is broken by fewer served, a.
    await pool.generate(PROMPT, SamplingParams(1))
    assert served(pool) == {"a": 3, "b": 3}


async def test_a_session_sticks_to_its_replica_whatever_the_load(pool, monkeypatch):
    await pool.pause()
    tasks = [await dispatch(pool, 50, session="s1")]  # idle: a
    tasks.append(await dispatch(pool, 20, session="s2"))  # 0 < 60: b
    assert tokens(pool) == {"a": 60, "b": 30}
    tasks.append(await dispatch(pool, 50, session="s1"))  # s1's: a, though 60 > 30
    assert tokens(pool) == {"a": 120, "b": 30}
    tasks.append(await dispatch(pool, 100, session="s2"))  # s2's: b (30 < 120 anyway)
    assert tokens(pool) == {"a": 120, "b": 140}
    tasks.append(await dispatch(pool, 5, session="s2"))  # s2's: b, though 140 > 120
    assert tokens(pool) == {"a": 120, "b": 155}
    tasks.append(await dispatch(pool, 5))  # no session: 120 < 155, a
    assert tokens(pool) == {"a": 135, "b": 155}
    await pool.resume()
    await asyncio.gather(*tasks)
    assert served(pool) == {"a": 3, "b": 3}

    # The session map keeps the most recently used sessions only.
    monkeypatch.setattr(pool_module, "MAX_STICKY_SESSIONS", 2)
    for session in ["s3", "s4", "s5", "s1"]:
        await pool.generate(PROMPT, SamplingParams(1), session=session)
    assert list(pool._sessions) == ["s5", "s1"]


async def test_a_replica_stopped_mid_flight_hands_its_requests_to_the_other(pool, engines, caplog):
    a, b = engines
    greedy = SamplingParams(max_new_tokens=100, temperature=0)
    tasks = [  # equal costs: a, b, a (tie, both served 0), b
        asyncio.create_task(pool.generate(PROMPT, greedy, session=f"s{i}")) for i in range(4)
    ]
    await until(lambda: decoding(a, 2) and decoding(b, 2))
    with caplog.at_level(logging.WARNING, logger="looprl.engines.pool"):
        await a.stop()
        gens = await asyncio.gather(*tasks)
    # Sent again from scratch: b's greedy outputs, none of a's partial tokens.
    assert all(g.output_ids == gens[1].output_ids and len(g.output_ids) == 100 for g in gens)
    assert all(g.finish_reason == "length" for g in gens)
    stats = pool.stats()
    assert stats["retries"] == 2
    assert stats["replicas"] == {
        "a": {
            "healthy": False,
            "outstanding_requests": 0,
            "outstanding_tokens": 0,
            "served": 0,
            "unhealthy_reason": "the local engine stopped before this request finished",
        },
        "b": {
            "healthy": True,
            "outstanding_requests": 0,
            "outstanding_tokens": 0,
            "served": 4,
            "unhealthy_reason": None,
        },
    }
    [warning] = caplog.records  # one, though two of a's requests failed
    assert "replica a is unavailable" in warning.getMessage()
    assert "local engine stopped" in warning.getMessage()
    # a's sessions moved: s0's next turn goes to b, and a gets nothing more.
    await pool.generate(PROMPT, SamplingParams(1), session="s0")
    await pool.generate(PROMPT, SamplingParams(1))
    assert served(pool) == {"a": 0, "b": 6}
    assert a._task is None  # never restarted by a new request


async def test_with_every_replica_gone_each_call_names_them_all(pool, engines, model):
    a, b = engines
    sampling = SamplingParams(max_new_tokens=300)
    tasks = [asyncio.create_task(pool.generate(PROMPT, sampling)) for _ in range(2)]  # a, b
    await until(lambda: decoding(a, 1) and decoding(b, 1))
    await a.stop()
    await until(lambda: decoding(b, 2))  # a's request, sent again to b
    await b.stop()
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        assert isinstance(result, EngineUnavailable)
        assert str(result) == (
            "no engine replica can serve: all 2 were marked unavailable (a: the local engine "
            "stopped before this request finished; b: the local engine stopped before this "
            "request finished). Fix what stopped them and restart the run"
        )
    assert pool.stats()["retries"] == 1
    with pytest.raises(EngineUnavailable, match="all 2 were marked unavailable"):
        await pool.generate(PROMPT, sampling)
    with pytest.raises(EngineUnavailable, match="all 2 were marked unavailable"):
        _ = pool.version
    with pytest.raises(EngineUnavailable, match="all 2 were marked unavailable"):
        await pool.update_weights(model.state_dict(), 1)
    assert a._task is None and b._task is None


async def test_a_bad_request_raises_its_error_and_marks_nothing(pool):
    with pytest.raises(EngineError, match="max_position_embeddings=1024") as raised:
        await pool.generate(PROMPT, SamplingParams(max_new_tokens=1024))
    assert not isinstance(raised.value, EngineUnavailable)
    stats = pool.stats()
    assert stats["retries"] == 0
    assert all(r["healthy"] and r["outstanding_tokens"] == 0 for r in stats["replicas"].values())
    assert len((await pool.generate(PROMPT, SamplingParams(2))).output_ids) == 2


async def test_update_weights_reaches_every_replica_and_version_is_the_lowest(pool, engines, model):
    a, b = engines
    state_dict = model.state_dict()
    await pool.update_weights(state_dict, 1)
    assert (a.version, b.version, pool.version) == (1, 1, 1)
    await a.update_weights(state_dict, 3)
    assert pool.version == 1
    await pool.pause()
    held = [await dispatch(pool, 2), await dispatch(pool, 2)]  # one on each, both held
    await asyncio.sleep(0.05)
    assert not any(task.done() for task in held)
    await pool.update_weights(state_dict, 4)
    await pool.resume()
    assert sorted(g.versions for g in await asyncio.gather(*held)) == [[4, 4], [4, 4]]
    assert pool.version == 4


async def test_update_weights_goes_on_past_a_server_that_is_gone(
    model, tokenizer, tiny_model_dir, tmp_path, caplog
):
    local = local_engine(model, tokenizer)
    with sglang_protocol_server(tiny_model_dir) as (url, _, _):
        cfg = EngineConfig(type="sglang", url=url, dtype="float32")
        remote = await SGLangEngine.connect(cfg, model=model, tokenizer=tokenizer, run_dir=tmp_path)
        pool = EnginePool([remote, local])
        greedy = SamplingParams(max_new_tokens=4, temperature=0)
        assert (await pool.generate(PROMPT, greedy)).output_ids == (
            await local.generate(PROMPT, greedy)
        ).output_ids
    # The server is gone: the next update marks it, and the local engine gets the weights.
    with caplog.at_level(logging.WARNING, logger="looprl.engines.pool"):
        await pool.update_weights(model.state_dict(), 2)
    assert (local.version, pool.version) == (2, 2)
    reason = pool.stats()["replicas"]["SGLangEngine[0]"]["unhealthy_reason"]
    assert reason.startswith(f"the SGLang server at {url} could not be reached")
    [warning] = caplog.records
    assert "replica SGLangEngine[0] is unavailable" in warning.getMessage()
    gen = await pool.generate(PROMPT, greedy)
    assert gen.versions == [2] * 4
    assert pool.stats()["replicas"]["LocalEngine[1]"]["served"] == 1
    await pool.stop()
    with pytest.raises(EngineUnavailable, match="was stopped"):
        await remote.generate(PROMPT, greedy)


async def test_a_pool_of_one_answers_as_its_replica(engines):
    a, _ = engines
    pool = EnginePool([a])
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    pooled, direct = await pool.generate(PROMPT, greedy), await a.generate(PROMPT, greedy)
    assert (pooled.output_ids, pooled.versions) == (direct.output_ids, direct.versions)
    assert pool.version == a.version
    with pytest.raises(EngineError, match="max_position_embeddings") as direct:
        await a.generate(PROMPT, SamplingParams(max_new_tokens=1024))
    with pytest.raises(EngineError, match="max_position_embeddings") as pooled:
        await pool.generate(PROMPT, SamplingParams(max_new_tokens=1024))
    assert str(pooled.value) == str(direct.value)


def test_replica_names_are_checked(engines):
    with pytest.raises(ValueError, match="at least one replica"):
        EnginePool([])
    with pytest.raises(ValueError, match="2 entries for 1 replicas"):
        EnginePool(engines[:1], names=["a", "b"])
    with pytest.raises(ValueError, match="'a' repeats"):
        EnginePool(engines, names=["a", "a"])


async def test_the_gateway_keeps_a_sessions_turns_on_one_replica(pool, tokenizer):
    app = create_app(
        pool,
        tokenizer,
        model_name="tiny",
        store=SessionStore(),
        default_sampling=SamplingConfig(max_new_tokens=4),
        max_model_len=1024,
    )
    async with GatewayServer(app) as server:
        handle = server.open_session()
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        async with AsyncOpenAI(base_url=handle.base_url, api_key=handle.api_key) as client:
            first = await client.chat.completions.create(model="m", messages=messages)
            messages += [{"role": "assistant", "content": first.choices[0].message.content}]
            messages += [{"role": "user", "content": "And 3 + 4?"}]
            await client.chat.completions.create(model="m", messages=messages)
        # Idle, the pool would have taken turns (b served fewer); the session kept a.
        assert served(pool) == {"a": 2, "b": 0}
        other = server.open_session()
        async with AsyncOpenAI(base_url=other.base_url, api_key=other.api_key) as client:
            await client.chat.completions.create(model="m", messages=messages[:1])
        assert served(pool) == {"a": 2, "b": 1}
