"""EnginePool restarting replicas that died, over real LocalEngines.

A replica "dies" by a real `stop()` while it decodes (its requests fail with
EngineUnavailable, as a dead server's or actor's do); its `restart()` starts its batcher
again once the test lets it (`may_restart`), so what the pool does meanwhile can be
checked. vLLM servers and Ray actors that are really killed: tests/integration/
test_engine_death.py and tests/e2e/test_ray.py.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from looprl.engines.base import EngineError, EngineUnavailable
from looprl.engines.local.engine import LocalEngine
from looprl.engines.pool import EnginePool
from looprl.models import load_model, load_tokenizer
from looprl.types import SamplingParams

PROMPT = list(range(100, 110))
GREEDY = SamplingParams(max_new_tokens=100, temperature=0)


class RestartableLocalEngine(LocalEngine):
    """A LocalEngine whose `restart()` waits for `may_restart`, fails the first
    `failing_restarts` times, then starts the batcher again."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.may_restart = asyncio.Event()
        self.may_restart.set()
        self.failing_restarts = 0
        self.restarted = 0

    async def restart(self) -> None:
        await self.may_restart.wait()
        if self.failing_restarts:
            self.failing_restarts -= 1
            raise EngineError("the engine would not start (the test's failure)")
        await self.start()
        self.restarted += 1


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture
async def engines(model, tiny_model_dir):
    decode = load_tokenizer(tiny_model_dir).decode
    engines = [RestartableLocalEngine(model, eos_token_ids=[], decode=decode) for _ in "ab"]
    yield engines
    for engine in engines:
        await engine.stop()


async def until(condition, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.002)


def decoding(engine: LocalEngine, rows: int) -> bool:
    return len(engine._rows) == rows and all(r.output_ids for r in engine._rows)


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "looprl.engines.pool"]


async def test_the_only_replica_dies_and_its_requests_wait_and_finish_on_it_restarted(
    engines, caplog
):
    a, _ = engines
    pool = EnginePool([a], names=["a"], max_restarts=2)
    expected = (await a.generate(PROMPT, GREEDY)).output_ids
    tasks = [asyncio.create_task(pool.generate(PROMPT, GREEDY)) for _ in range(3)]
    await until(lambda: decoding(a, 3))
    a.may_restart.clear()
    with caplog.at_level(logging.INFO, logger="looprl.engines.pool"):
        await a.stop()
        await until(lambda: pool.stats()["restarting"] == ["a"])
        await asyncio.sleep(0.2)  # they would have failed by now; they wait instead
        assert not any(task.done() for task in tasks)
        assert pool.version == 0  # a restarting replica still answers for its version
        a.may_restart.set()
        gens = await asyncio.wait_for(asyncio.gather(*tasks), 30)

    assert [g.output_ids for g in gens] == [expected] * 3  # whole, from scratch, once each
    stats = pool.stats()
    assert (stats["retries"], stats["restarts"], stats["restarting"]) == (3, 1, [])
    assert stats["replicas"]["a"]["healthy"] and stats["replicas"]["a"]["served"] == 3
    died, back = messages(caplog)
    assert died.startswith("Engine replica a is down: the local engine stopped before this")
    assert "Restarting it (restart 1 of engine.max_restarts=2); requests wait for it" in died
    assert back.startswith("Engine replica a is back after a ")
    assert back.endswith(
        "(restart 1 of engine.max_restarts=2), serving policy version 0; the 3 request(s) "
        "waiting for it are sent again"
    )


async def test_weights_and_pause_reach_a_restarting_replica_once_it_is_back(engines, model):
    a, _ = engines
    pool = EnginePool([a], names=["a"], max_restarts=1)
    held = asyncio.create_task(pool.generate(PROMPT, GREEDY))
    await until(lambda: decoding(a, 1))
    a.may_restart.clear()
    await a.stop()
    await until(lambda: pool.stats()["restarting"] == ["a"])
    pause = asyncio.create_task(pool.pause())
    update = asyncio.create_task(pool.update_weights(model.state_dict(), 5))
    await asyncio.sleep(0.1)
    assert not pause.done() and not update.done()  # they wait for it
    a.may_restart.set()
    await asyncio.wait_for(asyncio.gather(pause, update), 30)
    assert (a.version, pool.version) == (5, 5)
    await asyncio.sleep(0.2)
    assert not held.done()  # the restarted replica is paused, as the pool is
    await pool.resume()
    gen = await asyncio.wait_for(held, 30)
    assert gen.versions == [5] * 100


async def test_while_one_replica_restarts_the_other_serves_then_both_do(engines):
    a, b = engines
    pool = EnginePool([a, b], names=["a", "b"], max_restarts=1)
    tasks = [asyncio.create_task(pool.generate(PROMPT, GREEDY)) for _ in range(2)]  # a, b
    await until(lambda: decoding(a, 1) and decoding(b, 1))
    a.may_restart.clear()
    await a.stop()
    await asyncio.wait_for(asyncio.gather(*tasks), 30)  # a's sent again to b, not waiting
    assert pool.stats()["restarting"] == ["a"] and pool.stats()["retries"] == 1
    await pool.generate(PROMPT, SamplingParams(1))
    assert pool.stats()["replicas"]["b"]["served"] == 3
    a.may_restart.set()
    await until(lambda: pool.stats()["restarting"] == [])
    await pool.generate(PROMPT, SamplingParams(1))  # idle, a has served fewer
    assert pool.stats()["replicas"]["a"] == {
        "healthy": True,
        "outstanding_requests": 0,
        "outstanding_tokens": 0,
        "served": 1,
        "unhealthy_reason": None,
    }


async def test_a_replica_whose_restarts_fail_stays_down_and_calls_say_why(engines, caplog):
    a, _ = engines
    pool = EnginePool([a], names=["a"], max_restarts=2)
    a.failing_restarts = 2
    task = asyncio.create_task(pool.generate(PROMPT, GREEDY))
    await until(lambda: decoding(a, 1))
    with caplog.at_level(logging.INFO, logger="looprl.engines.pool"):
        await a.stop()
        with pytest.raises(EngineUnavailable) as failed:
            await asyncio.wait_for(task, 30)
    assert str(failed.value).startswith("no engine replica can serve: all 1 were marked")
    assert "restart 2 of engine.max_restarts=2 failed after 0 s: the engine would not" in str(
        failed.value
    )
    assert a.restarted == 0 and pool.stats()["restarts"] == 2
    logged = messages(caplog)
    assert sum("could not be restarted" in m for m in logged) == 2
    assert logged[-1].startswith("Engine replica a stays down: its engine.max_restarts=2")
    assert logged[-1].endswith("No replica is left: requests fail until the run is restarted")
    with pytest.raises(EngineUnavailable, match="all 1 were marked unavailable"):
        _ = pool.version
    # Once down for good, a failure is reported at once, with no restart.
    with pytest.raises(EngineUnavailable):
        await pool.generate(PROMPT, GREEDY)
    assert pool.stats()["restarts"] == 2


async def test_restarts_need_replicas_that_can_restart(model, tiny_model_dir):
    plain = LocalEngine(model, eos_token_ids=[], decode=load_tokenizer(tiny_model_dir).decode)
    with pytest.raises(ValueError, match=r"replica x \(LocalEngine\) has no restart\(\)"):
        EnginePool([plain], names=["x"], max_restarts=1)
    with pytest.raises(ValueError, match="max_restarts=-1 must be >= 0"):
        EnginePool([plain], max_restarts=-1)
    assert EnginePool([plain]).stats()["restarts"] == 0  # without restarts, any engine
