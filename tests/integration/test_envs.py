"""Environments played end to end: EnvWorkflow -> gateway over HTTP -> LocalEngine (the
tiny model, greedy), the envs in real worker processes (looprl/envs/).

Each episode's calls are checked as training sees them: one sample per call, its loss
mask on the tokens that call sampled, its reward the return-to-go worked out by hand,
and the rollout's reward the episode return. Failing envs (a worker that dies, a step
that hangs, an env that raises) end only their episode, are counted, and the run goes on;
no worker process outlives its pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from looprl import startup
from looprl.commands.collect import collect
from looprl.config import load_config
from looprl.envs.base import EnvCrashed, EnvFailed, EnvTimedOut
from looprl.envs.workers import KILL_WAIT_S, STOP_GRACE_S, EnvWorkers
from looprl.scheduling.single_process import start_single_process
from looprl.tasks import load_task
from looprl.workflows.resolution import configured_workflow
from tests.support.tiny_run import train_two_steps


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split(") ")[1][0] != "Z"


@contextlib.contextmanager
def count_workers(step_timeout_s: float):
    """One started CountEnv worker (episodes of 9 steps), closed whatever the test does."""
    workers = EnvWorkers("tests.support.envs:CountEnv", {"length": 9}, 1, step_timeout_s)
    workers.start()
    try:
        yield workers
    finally:
        workers.close()


async def _play(model_dir, rows: list[dict], *overrides: str):
    """`rows` played once each, greedily, by the tiny model; (result, workflow, tokenizer)."""
    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            "engine.dtype=float32",
            "sampling.temperature=0",
            "sampling.max_new_tokens=6",
            "rollout.group_size=1",
            *overrides,
        ],
    )
    workflow = configured_workflow(cfg, load_task(cfg.task))
    try:
        async with start_single_process(startup.start(cfg, train=False), workflow) as parts:
            result = await parts.controller.rollout_batch(rows)
            return result, workflow, parts.tokenizer
    finally:
        workflow.close()


def _check_samples(outcome, tokenizer) -> None:
    """One sample per call, whose loss mask covers exactly the tokens that call sampled
    and whose prompt is the chat the workflow sent."""
    assert len(outcome.trajectories) == len(outcome.calls)
    for sample, call in zip(outcome.trajectories, outcome.calls, strict=True):
        sampled = sample.input_ids[sample.loss_mask]
        assert (
            tokenizer.decode(sampled, skip_special_tokens=True)
            .strip()
            .startswith(call["reply"].strip())
        )
        assert sample.loss_mask[-len(sampled) :].all()  # the reply ends the sample
        assert not sample.loss_mask[: -len(sampled)].any()
        prompt = tokenizer.decode(sample.input_ids[~sample.loss_mask])
        assert call["messages"][-1]["content"] in prompt


async def test_each_call_gets_its_return_to_go_and_the_rollout_the_return(tiny_model_dir):
    # CountEnv: reward 1 per step, done after 3 steps, any reply is an action.
    result, _, tokenizer = await _play(
        tiny_model_dir,
        [{"seed": 5}, {"seed": 6}],
        "env.name=tests.support.envs:CountEnv",
        "env.discount=0.5",
    )
    assert result.stats()["completed"] == 2
    for outcome, seed in zip(result.outcomes, (5, 6), strict=True):
        # G2 = 1, G1 = 1 + 0.5 * 1 = 1.5, G0 = 1 + 0.5 * 1.5 = 1.75; the return is 3
        assert [t.reward for t in outcome.trajectories] == [1.75, 1.5, 1.0]
        assert [c["reward"] for c in outcome.calls] == [1.75, 1.5, 1.0]
        assert outcome.reward == 3.0 and outcome.success is True
        shown = [c["messages"][-1]["content"] for c in outcome.calls]
        assert shown == [f"seed {seed}, step 0", "step 1", "step 2"]  # history_turns=0
        assert all(len(c["messages"]) == 1 for c in outcome.calls)
        _check_samples(outcome, tokenizer)


async def test_an_episode_cut_by_max_turns_is_judged_by_the_envs_last_success(tiny_model_dir):
    # SummitEnv: reward 1 a step, success only at step 3. Cut at 2 turns the return is 2,
    # yet the episode failed (the env said so on its last step); at 3 it succeeded.
    for max_turns, success in ((2, False), (3, True)):
        result, _, _ = await _play(
            tiny_model_dir,
            [{"seed": 1}],
            "env.name=tests.support.envs:SummitEnv",
            f"env.max_turns={max_turns}",
            "env.workers=1",
        )
        (outcome,) = result.outcomes
        assert (outcome.reward, outcome.success) == (float(max_turns), success)
        assert result.stats()["accuracy"] == float(success)


async def test_frozen_lake_episodes_through_the_gateway(tiny_model_dir):
    result, _, tokenizer = await _play(
        tiny_model_dir,
        [{"seed": 1_000_000}, {"seed": 1_000_001}],
        "env.name=gymnasium:FrozenLake-v1",
        "env.kwargs={random_map_size: 3}",
        "env.max_turns=3",
        "env.invalid_action_reward=-0.1",
        "env.history_turns=1",
        "env.system_prompt=Walk to the goal.",
    )
    stats = result.stats()
    assert stats["completed"] == 2 and stats["errors"] == {}
    for outcome in result.outcomes:
        calls = outcome.calls
        # The random tiny model names no move: every reply is rejected and costs 0.1.
        assert len(calls) == 3
        assert [t.reward for t in outcome.trajectories] == pytest.approx([-0.3, -0.2, -0.1])
        assert outcome.reward == pytest.approx(-0.3) and outcome.success is False
        first = calls[0]["messages"]
        assert first[0] == {"role": "system", "content": "Walk to the goal."}
        assert first[1]["content"].startswith("You are at row 1, column 1 of a 3x3 frozen lake")
        for before, after in zip(calls, calls[1:], strict=False):
            # the env's message, then the unchanged observation; one earlier turn kept
            shown = after["messages"][-1]["content"]
            reply = " ".join(before["reply"].split())[:60]
            assert shown.startswith(f"{reply!r} is not a move. Reply with one word: left, down")
            assert shown.endswith(first[1]["content"])
            assert after["messages"][1:3] == [
                {"role": "user", "content": before["messages"][-1]["content"]},
                {"role": "assistant", "content": before["reply"]},
            ]
        _check_samples(outcome, tokenizer)


async def test_textarena_guess_the_number_through_the_gateway(tiny_model_dir):
    result, _, tokenizer = await _play(
        tiny_model_dir,
        [{"seed": 3}, {"seed": 4}],
        "env.name=textarena:GuessTheNumber-v0",
        "env.max_turns=4",
        "env.invalid_action_reward=-0.5",
    )
    assert result.stats()["completed"] == 2
    for outcome in result.outcomes:
        # No [number] in the tiny model's replies: TextArena rejects the first one (its
        # error allowance is 1) and ends the game at the second, with its reward for no
        # guess at all (0). Credit: [-0.5 + 0, 0].
        calls = outcome.calls
        assert len(calls) == 2
        assert "Guess The Number" in calls[0]["messages"][-1]["content"]
        assert calls[1]["messages"][-1]["content"].startswith("You attempted an invalid move.")
        assert [t.reward for t in outcome.trajectories] == [-0.5, 0.0]
        assert outcome.reward == -0.5 and outcome.success is False
        _check_samples(outcome, tokenizer)


async def test_failing_envs_end_their_episode_only_and_the_run_goes_on(tiny_model_dir):
    # Misbehaving: seed % 4 == 1 kills its worker, == 2 hangs, == 3 raises.
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "engine.dtype=float32",
            "sampling.max_new_tokens=4",
            "rollout.group_size=1",
            "env.name=tests.support.envs:Misbehaving",
            "env.workers=1",
            "env.step_timeout_s=2",
        ],
    )
    workflow = configured_workflow(cfg, load_task(cfg.task))
    try:
        async with start_single_process(startup.start(cfg, train=False), workflow) as parts:
            first = await parts.controller.rollout_batch([{"seed": s} for s in range(4)])
            again = await parts.controller.rollout_batch([{"seed": 4}, {"seed": 8}])
    finally:
        workflow.close()
    stats = first.stats()
    assert stats["completed"] == 1 and stats["failed"] == 3
    assert stats["errors"] == {"EnvCrashed": 1, "EnvTimedOut": 1, "EnvFailed": 1}
    assert [o.status for o in first.outcomes] == ["completed", "failed", "failed", "failed"]
    assert first.outcomes[0].reward == 3.0
    assert again.stats()["completed"] == 2  # on the restarted worker
    assert workflow.workers.counts == {"crashed": 1, "timed_out": 1, "failed": 1, "restarts": 2}


async def test_a_restarted_worker_rebuilds_the_episodes_it_held():
    with count_workers(5.0) as workers:
        async with workers.episode() as doomed, workers.episode() as bystander:
            await doomed.reset(1)
            await bystander.reset(2)
            assert (await bystander.step("a"))[0] == "step 1"
            pid = workers.pids()[0]
            with pytest.raises(EnvCrashed, match=r"died during step\(\) \(exit code 3\)"):
                await doomed.step("crash")
            assert not _alive(pid) and workers.pids() != [pid]
            # replayed on the new worker (reset, then "a"), then this step
            assert await bystander.step("b") == ("step 2", 1.0, False, {})
            with pytest.raises(EnvFailed, match="RuntimeError: the env broke on purpose"):
                await bystander.step("raise")
            await doomed.reset(3)
            with pytest.raises(EnvFailed, match="non-finite reward nan"):
                await doomed.step("nan")
        async with workers.episode() as flaky, workers.episode() as other:
            await flaky.reset(1)
            await other.reset(2)
            await flaky.step("random")  # an observation a replay cannot give back
            with pytest.raises(EnvTimedOut, match="ran past env.step_timeout_s=5"):
                await other.step("hang")
            with pytest.raises(EnvCrashed, match="not deterministic in its seed"):
                await flaky.step("a")
        assert workers.counts == {"crashed": 2, "failed": 2, "timed_out": 1, "restarts": 2}


async def test_a_cancelled_call_does_not_shift_the_replies():
    with count_workers(5.0) as workers:
        async with workers.episode() as other:
            await other.reset(2)

            async def cancelled_mid_step():
                async with workers.episode() as episode:
                    await episode.reset(1)
                    await episode.step("slow")  # 1 s in the worker

            task = asyncio.ensure_future(cancelled_mid_step())
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # the slow step's late reply is read and dropped, not taken for this one's
            assert await other.step("a") == ("step 1", 1.0, False, {})
            assert await other.step("b") == ("step 2", 1.0, False, {})
        assert workers.counts == {}


async def test_a_restart_kills_what_the_env_started():
    with count_workers(2.0) as workers:
        async with workers.episode() as episode:
            await episode.reset(1)
            child = int((await episode.step("spawn"))[0].split()[1])
            assert _alive(child)
            with pytest.raises(EnvTimedOut):
                await episode.step("hang")
            assert not _alive(child), "the env's own process outlived its worker"


async def test_close_kills_a_worker_deaf_to_sigterm_and_its_children_within_the_bound():
    workers = EnvWorkers("tests.support.envs:CountEnv", {"length": 9}, 1, 600.0)
    workers.start()
    (worker,) = workers.pids()
    async with workers.episode() as episode:
        await episode.reset(1)
        child = int((await episode.step("spawn"))[0].split()[1])
        stuck = asyncio.ensure_future(episode.step("hang, deaf to SIGTERM"))
        await asyncio.sleep(0.5)
        start = time.monotonic()
        workers.close()  # the socket closed, SIGTERM ignored: SIGKILL after the grace
        elapsed = time.monotonic() - start
        stuck.cancel()
    assert 2 * STOP_GRACE_S <= elapsed < 2 * STOP_GRACE_S + KILL_WAIT_S
    assert not _alive(worker) and not _alive(child)
    assert multiprocessing.active_children() == []


async def test_a_reply_larger_than_the_socket_buffer_is_read_whole():
    with count_workers(30.0) as workers:
        async with workers.episode() as episode:
            await episode.reset(1)
            observation, *_ = await episode.step("long")
            assert observation == "x" * (3 << 20)
            assert await episode.step("a") == ("step 2", 1.0, False, {})


def test_a_wrong_env_fails_at_start_naming_it():
    workers = EnvWorkers("tests.support.envs:broken_factory", {"x": 1}, 1, 5.0)
    with pytest.raises(ValueError, match=r"env.name='tests.support.envs:broken_factory'.*"
                       r"RuntimeError: cannot build this env"):  # fmt: skip
        workers.start()
    assert multiprocessing.active_children() == []


async def test_close_leaves_no_worker_behind():
    workers = EnvWorkers("gymnasium:FrozenLake-v1", {}, 2, 5.0)
    workers.start()
    async with workers.episode() as env:
        await env.reset(0)
        pids = workers.pids()
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        hung = EnvWorkers("tests.support.envs:CountEnv", {}, 1, 600.0)
        hung.start()
        async with hung.episode() as stuck:
            await stuck.reset(0)
            task = asyncio.ensure_future(stuck.step("hang"))
            await asyncio.sleep(0.5)
            start = time.monotonic()
            hung.close()  # a worker stuck in a step is terminated
            assert time.monotonic() - start < 5
            task.cancel()
    workers.close()
    workers.close()  # idempotent
    assert not any(_alive(p) for p in pids)
    assert multiprocessing.active_children() == []


def test_workers_exit_when_their_parent_is_killed(tmp_path):
    """...and take what their envs started with them."""
    script = textwrap.dedent(
        """
        import asyncio, json, time
        from looprl.envs.workers import EnvWorkers

        async def main():
            workers = EnvWorkers("tests.support.envs:CountEnv", {}, 2, 5.0)
            workers.start()
            async with workers.episode() as episode:
                await episode.reset(0)
                child = int((await episode.step("spawn"))[0].split()[1])
                print(json.dumps([*workers.pids(), child]), flush=True)
                time.sleep(600)

        if __name__ == "__main__":
            asyncio.run(main())
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        pids = json.loads(parent.stdout.readline())
        assert all(_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids)
    finally:
        parent.kill()


async def test_looprl_train_on_frozen_lake_two_steps(tiny_run):
    summary, steps, evals = await train_two_steps(
        tiny_run(
            "env.name=gymnasium:FrozenLake-v1",
            "env.kwargs={random_map_size: 3}",
            "env.max_turns=2",
            "env.invalid_action_reward=-0.1",
            "task.eval_size=3",
        )
    )
    assert all(r["completed"] == 4 and r["errors"] == {} for r in steps)
    # 4 episodes of 2 turns, each a sample of its own
    assert all(r["trajectories"] == 8 for r in steps)
    assert [r["rollouts"] for r in evals] == [3, 3]
    assert summary.accuracy_before == evals[0]["accuracy"]
    assert multiprocessing.active_children() == []  # the env workers stopped with the run


async def test_looprl_rollout_plays_an_env_and_closes_its_workers(tiny_model_dir, tmp_path):
    """`looprl rollout env.name=...`: the command opens the EnvWorkflow through start-up,
    plays the episodes, and closes the env's worker processes when it ends."""
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "env.name=tests.support.envs:CountEnv",
            "env.workers=2",
            f"run.fileroot={tmp_path}",
            "engine.dtype=float32",
            "rollout.group_size=1",
            "sampling.max_new_tokens=4",
        ],
    )
    out = tmp_path / "rollouts.jsonl"
    before = set(multiprocessing.active_children())
    result = await collect(cfg, rows=2, split="train", out=out)
    assert result.stats()["completed"] == 2
    assert len(out.read_text().splitlines()) >= 2  # the episodes' samples
    assert set(multiprocessing.active_children()) <= before  # the env workers stopped
