"""The Ray scheduler on this CPU: engine replicas and trainer ranks as real Ray actors,
the driver keeping the gateway and the controller.

The first test's run starts a local Ray of its own and shuts it down, as `looprl train
scheduler.type=ray` does; the others join one local Ray that this module starts once
(`local_ray`: a start costs ~10-20 s of the 2-core test machine), which a run leaves up,
and each must leave no actor of its own running in it. Module, not session, scope:
tests/e2e/test_two_nodes.py needs a process that is not connected to any Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import time

import httpx
import psutil
import pytest
import ray
from openai import AsyncOpenAI

from looprl import startup
from looprl.config import load_config
from looprl.diagnostics.watchdog import registered
from looprl.engines.servers.process import free_port
from looprl.loop import train
from looprl.scheduling.ranks import RankFailed
from looprl.scheduling.ray import init_ray, start_ray_actors
from looprl.scheduling.ray_actors import EngineReplica, TrainerRank
from looprl.training.batch import build_batch
from tests.support.toy_job import learned_steps, toy_job

pytestmark = pytest.mark.slow


class LongAnswer:
    """One chat call sampling 96 tokens; reward 1 when it came back whole."""

    async def run(self, data, *, base_url, api_key, model, **kw):
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            response = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": data["question"]}],
                max_tokens=96,
            )
        return float(len(response.choices[0].token_ids) > 0)


async def test_killed_engine_replica_is_detected_and_its_requests_finish_on_the_other(
    tiny_model_dir, tmp_path
):
    """On a local Ray that the run starts and shuts down itself (the module's first
    test, before `local_ray` starts the one the others share), unless this process
    already had one, which the run joins and leaves up."""
    ours = not ray.is_initialized()
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"run.fileroot={tmp_path}",
            "scheduler.type=ray",
            "scheduler.engine_replicas=2",
            "engine.max_restarts=0",  # it stays down (a restart: the test below)
            "engine.dtype=float32",
            "sampling.temperature=1.0",
        ],
    )
    rows = [{"question": f"Count to {i}."} for i in range(8)]
    async with start_ray_actors(startup.start(cfg), LongAnswer()) as parts:
        pool = parts.engine
        run = asyncio.create_task(parts.controller.rollout_batch(rows, group_size=1))
        for _ in range(600):  # wait until both replicas are decoding
            busy = [r["outstanding_requests"] for r in pool.stats()["replicas"].values()]
            if all(n > 0 for n in busy):
                break
            await asyncio.sleep(0.05)
        assert all(n > 0 for n in busy), pool.stats()
        victim = pool.engines[0]
        os.kill(victim.info["pid"], signal.SIGKILL)
        result = await asyncio.wait_for(run, timeout=300)

        stats = result.stats()
        assert stats["completed"] == 8 and stats["failed"] == 0, stats
        health = pool.stats()
        replicas = health["replicas"]
        assert replicas["replica-0"]["healthy"] is False
        assert "died" in replicas["replica-0"]["unhealthy_reason"]
        assert replicas["replica-1"]["healthy"] is True
        assert health["retries"] >= 1
        async with httpx.AsyncClient() as http:  # what the gateway tells a user
            reported = (await http.get(f"{parts.gateway.url}/health")).json()["engine"]
        assert reported["replicas"]["replica-0"]["healthy"] is False
        # The pool goes on with the survivor: its version, and new requests, are its own.
        again = await parts.controller.rollout_batch(rows[:2], group_size=1)
        assert again.stats()["completed"] == 2
    assert ray.is_initialized() != ours  # a Ray it started is shut down, else left up


# The process titles of looprl's actors ("ray::TrainerRank.stop" while one stops).
ACTORS = tuple(f"ray::{actor.__name__}" for actor in (EngineReplica, TrainerRank))


def _actor_processes() -> list[psutil.Process]:
    """looprl's actors among this process's descendants (the local Ray's workers)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # it exited meanwhile
            if "".join(child.cmdline()[:1]).startswith(ACTORS):
                found.append(child)
    return found


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module's runs, started as a run starts one (or the one this
    process already has, left up)."""
    if ray.is_initialized():
        yield
        return
    init_ray(None)
    yield
    ray.shutdown()


@pytest.fixture
def shared_ray(local_ray):
    """`local_ray` for one test, which must leave none of its actors running there (its
    stop kills them; until now the end of its own Ray did)."""
    yield
    deadline = time.monotonic() + 30  # ray.kill returns before the process is gone
    while (left := _actor_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    said = [p.cmdline() for p in left]
    for process in left:  # the next test starts without them
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    assert not left, f"actors still running after the run: {said}"


@pytest.mark.usefixtures("shared_ray")
@pytest.mark.parametrize("weight_sync", ["memory", "broadcast", "memory, LoRA"])
async def test_default_job_on_ray_with_two_replicas_and_two_ranks_learns(
    peaked_model_dir, tmp_path, weight_sync
):
    """The toy reward of tests/support/toy_job.py (fraction of even token ids), trained
    by 2 gloo ranks (FSDP2) with 2 engine replicas behind the gateway; new weights reach
    the replicas through Ray's object store, or broadcast in buckets from rank 0 (gloo
    here, the NCCL path on GPUs); with model.lora the ranks gather the adapter only and
    the replicas apply it."""
    lora = weight_sync.endswith("LoRA")
    cfg = toy_job(
        peaked_model_dir,
        tmp_path,
        "scheduler.type=ray",
        "scheduler.engine_replicas=2",
        "scheduler.trainer_ranks=2",
        f"scheduler.weight_sync={weight_sync.split(',')[0]}",
        "scheduler.bucket_mb=1",  # several buckets
        # Adapters learn slower here than in one process (CI: eval 0.28 -> 0.5 at 3e-3).
        *(["model.lora.rank=8", "train.lr=6e-3"] if lora else []),
    )
    summary = await train(cfg, show_progress=False)

    steps = learned_steps(cfg, f"ray, 2 replicas, 2 ranks, {weight_sync}")
    assert [r["staleness_max"] for r in steps] == [0] * 10
    names = {p.name for p in registered(cfg.run_dir)}
    assert {"rank-0", "rank-1", "engine-0", "engine-1", "driver"} <= names, names
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    assert (summary.model_dir / weights).is_file()


@pytest.mark.usefixtures("shared_ray")
async def test_a_killed_trainer_rank_stops_every_rank_and_is_named(tiny_model_dir, tmp_path):
    """SIGKILL one of two gloo ranks; the next step fails at once (not after the
    collective timeout), names that rank, and leaves no rank running."""
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"run.fileroot={tmp_path}",
            "scheduler.type=ray",
            "scheduler.trainer_ranks=2",
            "engine.dtype=float32",
            "sampling.max_new_tokens=8",
        ],
    )
    rows = [{"question": "Count to 3."}, {"question": "Count to 4."}]
    async with start_ray_actors(startup.start(cfg), LongAnswer()) as parts:
        rollout = await parts.controller.rollout_batch(rows, group_size=2)
        batch, _ = build_batch(rollout.trajectories, "grpo", parts.tokenizer.pad_token_id)
        await parts.trainer.train_step(batch)  # both ranks work
        ranks = [p for p in registered(cfg.run_dir) if p.role == "rank"]  # in rank order
        assert [p.rank for p in ranks] == [0, 1]
        os.kill(ranks[1].pid, signal.SIGKILL)
        with pytest.raises(RankFailed, match=r"trainer rank 1 of 2 \(pid \d+ on node ") as failed:
            await asyncio.wait_for(parts.trainer.train_step(batch), timeout=120)
        assert failed.value.rank == 1
        assert "is still in the cluster" in str(failed.value)  # the process died, not its node
        for _ in range(100):  # rank 0 killed by the group, not left waiting in a collective
            if not ranks[0].alive():
                break
            await asyncio.sleep(0.1)
        assert not ranks[0].alive()


@pytest.mark.usefixtures("shared_ray")
async def test_the_only_engine_replica_killed_mid_rollout_is_restarted_and_training_goes_on(
    tiny_model_dir, tmp_path, caplog
):
    """One replica (a local engine in a Ray actor) SIGKILLed while it serves step 2's
    rollouts: the pool starts a new actor loaded with the trainer's weights of version 1,
    the requests that were on the dead one wait and are sent again to it, and the run
    finishes every step, nothing failed and nothing stale."""
    port = free_port()
    cfg = toy_job(
        tiny_model_dir,
        tmp_path,
        "scheduler.type=ray",
        "train.total_steps=4",
        "rollout.batch_size=2",
        "rollout.group_size=4",
        "sampling.max_new_tokens=48",
        f"gateway.port={port}",
    )
    caplog.set_level(logging.INFO, logger="looprl")
    run = asyncio.create_task(train(cfg, show_progress=False))
    metrics = cfg.run_dir / "metrics.jsonl"

    def trained() -> list[dict]:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        return [r for r in map(json.loads, lines) if r["kind"] == "train"]

    async with asyncio.timeout(600), httpx.AsyncClient() as http:
        while not trained():  # step 1 trained: its weights (version 1) reached the replica
            assert not run.done(), run.result()
            await asyncio.sleep(0.1)
        while True:  # then step 2's rollouts are on it
            engine = (await http.get(f"http://127.0.0.1:{port}/health")).json()["engine"]
            if engine["replicas"]["replica-0"]["outstanding_requests"] > 0:
                break
            await asyncio.sleep(0.02)
    [old] = [p for p in registered(cfg.run_dir) if p.name == "engine-0"]
    os.kill(old.pid, signal.SIGKILL)
    summary = await asyncio.wait_for(run, 600)

    steps = trained()
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and summary.steps == 4
    assert [r["version"] for r in steps] == [1, 2, 3, 4]
    for r in steps:  # every rollout completed; the restarted replica served version 1
        assert (r["completed"], r["failed"], r["timed_out"]) == (8, 0, 0), r
        assert r["staleness_max"] == 0 and r["dropped_stale_groups"] == 0, r
    [new] = [p for p in registered(cfg.run_dir) if p.name == "engine-0"]
    assert new.pid != old.pid  # a new actor took its place
    said = [r.getMessage() for r in caplog.records]
    died = next(m for m in said if m.startswith("Engine replica replica-0 is down: "))
    assert f"(pid {old.pid} on " in died and "restart 1 of engine.max_restarts=3" in died
    assert "requests wait for it, and those it was serving are sent again" in died
    replaced = next(m for m in said if m.startswith("Engine replica-0: a new actor (pid "))
    assert f"(pid {new.pid} on " in replaced and f"died (pid {old.pid} on " in replaced
    assert replaced.endswith("loaded with the trainer's weights of version 1")
    back = next(m for m in said if m.startswith("Engine replica replica-0 is back after a "))
    waited = re.search(r"serving policy version 1; the (\d+) request\(s\) waiting", back)
    assert waited and int(waited.group(1)) >= 1, back  # sent again, counted in the log
