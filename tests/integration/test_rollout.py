"""The rollout path end to end: RolloutController -> gateway over HTTP -> LocalEngine.

Every test runs `start_single_process` (the real engine on the tiny model, the real gateway on
loopback, the real controller) with workflows written as users write them: a plain
`AsyncOpenAI` client on the `base_url` the controller hands over, returning a reward.
Nothing is mocked; where a test needs to see what the gateway recorded, its workflow
looks its own session up in the store while it runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import httpx
import pytest
import torch

from looprl import startup
from looprl.config import Config, load_config
from looprl.gateway.sessions import Session, SessionStore
from looprl.models import load_model, load_tokenizer
from looprl.rollout.outcome import RolloutResult
from looprl.scheduling.single_process import start_single_process
from looprl.training.batch import call_positions
from looprl.types import Interaction, Trajectory
from tests.support.rollouts import (
    QUESTION,
    Counting,
    groups_of,
    openai_client,
    repeat_row,
    rollout_config,
)

FOLLOW_UP = "Say it again."


def _two_groups_of_two(model_dir, max_head_offpolicyness: int) -> Config:
    """Batches of 2 prompts x 2 samples, admitted under the given staleness bound."""
    return rollout_config(
        model_dir,
        "rollout.group_size=2",
        "rollout.batch_size=2",
        f"rollout.max_head_offpolicyness={max_head_offpolicyness}",
    )


def _session_id(base_url: str) -> str:
    return base_url.rstrip("/").split("/")[-2]  # .../sessions/{id}/v1


def _sampled_versions(result: RolloutResult) -> set[int]:
    return {v for t in result.trajectories for v in t.versions[t.loss_mask].tolist()}


# ---- workflows that misbehave ----------------------------------------------------------


class Misbehaving:
    """Does what `data["kind"]` says; every kind but `no_call` makes one model call first."""

    async def run(self, data: dict, *, base_url: str, api_key: str, model: str, **kw: Any):
        kind = data["kind"]
        if kind == "no_call":
            return 1.0
        async with openai_client(base_url, api_key) as client:
            await client.chat.completions.create(model=model, messages=QUESTION)
            while kind == "hangs_in_call":  # generating until cancelled
                await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=500)
        if kind == "raises":
            raise ValueError("the agent broke")
        if kind == "hangs":
            await asyncio.sleep(3600)
        return {"good": 1.0, "none": None, "nan": math.nan, "string": "1.0"}[kind]


EXPECTED = {  # kind -> (status, error type)
    "good": ("completed", None),
    "raises": ("failed", "ValueError"),
    "hangs": ("timed_out", "TimeoutError"),
    "hangs_in_call": ("timed_out", "TimeoutError"),
    "none": ("rejected", None),
    "nan": ("failed", "InvalidReward"),
    "string": ("failed", "InvalidReward"),
    "no_call": ("failed", "NoTrajectory"),
}


async def test_bad_workflows_are_counted_by_outcome_and_none_is_fatal(tiny_model_dir, caplog):
    kinds = ["good", "raises", "hangs", "none", "good", "nan", "string", "no_call"]
    kinds += ["hangs_in_call", "raises", "good"]
    # Long enough for the good ones' calls on a loaded 2-core machine, short for a test.
    # 7 of 11 fail: counted here, with the failure budget off (it would stop the batch).
    cfg = rollout_config(tiny_model_dir, "rollout.timeout_s=4", "rollout.max_failure_share=1")
    caplog.set_level(logging.WARNING, logger="looprl.rollout.controller")
    async with start_single_process(startup.start(cfg, train=False), Misbehaving()) as parts:
        start = time.monotonic()
        result = await parts.controller.rollout_batch([{"kind": k} for k in kinds])
        elapsed = time.monotonic() - start
        assert len(parts.gateway.store) == 0  # every session closed, whatever its workflow did
        after = await parts.controller.rollout_batch([{"kind": "good"}])

    for kind, outcome in zip(kinds, result.outcomes, strict=True):
        status, error = EXPECTED[kind]
        assert outcome.status == status, (kind, outcome)
        assert (outcome.error or "").split(":")[0] == (error or ""), (kind, outcome.error)
        assert bool(outcome.trajectories) == (kind == "good"), kind
    stats = result.stats()
    assert stats["rollouts"] == len(kinds)
    counts = {k: stats[k] for k in ("completed", "rejected", "failed", "timed_out")}
    assert counts == {"completed": 3, "rejected": 1, "failed": 5, "timed_out": 2}
    assert stats["errors"] == {
        "ValueError": 2,
        "TimeoutError": 2,
        "InvalidReward": 2,
        "NoTrajectory": 1,
    }
    assert stats["trajectories"] == 3 and stats["reward_mean"] == 1.0
    assert all(t.reward == 1.0 and t.num_sampled_tokens == 4 for t in result.trajectories)
    # The hanging workflows were cut off at timeout_s and did not hold the batch up.
    assert elapsed < 2 * cfg.rollout.timeout_s, elapsed
    assert after.outcomes[0].status == "completed"
    assert "'1.0' (str)" in result.outcomes[kinds.index("string")].error
    # The first error of each type is logged with its message, later ones only counted.
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == len(stats["errors"])
    assert sum("ValueError: the agent broke" in w for w in warnings) == 1


# ---- multi-turn: concat and per_call ---------------------------------------------------

SCRIPT = "Sure, it is five."


@pytest.fixture(scope="module")
def scripted(tiny_model_dir) -> tuple[torch.nn.Module, list[int]]:
    """The tiny model rewired to answer SCRIPT then <|im_end|>, whatever the prompt.

    With attention and MLP outputs zeroed, the residual stream at each position is the
    current token's embedding, so the next token depends on the current one only: every
    other token leads to SCRIPT's first token, each SCRIPT token to the next, the last
    to <|im_end|>, with a logit margin of 80 (sampling at temperature 1 cannot stray).
    Why not the random tiny model: it samples token sequences that re-tokenize
    differently once the agent sends their text back ('da' + 'ges' comes back as 'd' +
    'ages': about 1 in 4 of its 8-token answers), a legitimate concat break. A trained
    model mostly says tokenizer-canonical text, as this one always does.
    """
    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_model(tiny_model_dir)
    script = tokenizer.encode(SCRIPT, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert len(set(script)) == len(script), "each state of the chain needs its own token"
    basis = torch.eye(model.config.hidden_size)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embed = model.get_input_embeddings().weight
        embed[:] = basis[0]
        for state, token in enumerate(script[:-1], start=1):
            embed[token] = basis[state]
        head = model.lm_head.weight
        head.zero_()
        for state, token in enumerate(script):
            head[token] = 10 * basis[state]
    return model, script


class TwoTurns:
    """Ask, send the answer back as the assistant turn with a follow-up, ask again."""

    def __init__(self, edit_history: bool = False):
        self.store: SessionStore | None = None  # set once launched
        self.edit_history = edit_history
        self.sessions: dict[str, Session] = {}

    async def run(self, data: dict, *, base_url: str, api_key: str, model: str, **kw: Any):
        session_id = _session_id(base_url)
        self.sessions[session_id] = self.store.get(session_id)
        messages = list(QUESTION)
        async with openai_client(base_url, api_key) as client:
            first = await client.chat.completions.create(model=model, messages=messages)
            answer = first.choices[0].message.content
            if self.edit_history:
                answer = "I said something else."
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": FOLLOW_UP},
            ]
            await client.chat.completions.create(model=model, messages=messages, max_tokens=3)
        return 1.0


async def _two_turn_rollouts(cfg: Config, model=None, **workflow_kw) -> tuple[RolloutResult, dict]:
    workflow = TwoTurns(**workflow_kw)
    async with start_single_process(
        startup.start(cfg, train=False), workflow, model=model
    ) as parts:
        workflow.store = parts.gateway.store
        result = await parts.controller.rollout_batch([{}], group_size=2)
    return result, workflow.sessions


def _check_sample(t: Trajectory, calls: list[Interaction]) -> None:
    """`t` is `calls` laid end to end: prompt context masked, every sampled token not."""
    ids, mask = t.input_ids.tolist(), []
    for it in calls:
        assert ids[: len(it.prompt_ids)] == it.prompt_ids
        assert ids[len(it.prompt_ids) : len(it.prompt_ids) + len(it.output_ids)] == it.output_ids
        mask += [False] * (len(it.prompt_ids) - len(mask)) + [True] * len(it.output_ids)
    assert len(ids) == len(mask)
    assert t.loss_mask.dtype == torch.bool and t.loss_mask.is_contiguous()
    assert t.loss_mask.tolist() == mask
    sampled = [lp for it in calls for lp in it.logprobs]
    assert t.behavior_logprobs[t.loss_mask].tolist() == pytest.approx(sampled)
    assert (t.behavior_logprobs[~t.loss_mask] == 0).all()
    assert t.versions[t.loss_mask].tolist() == [0] * len(sampled)
    assert (t.versions[~t.loss_mask] == -1).all()


async def test_two_turns_concat_into_one_sample_masking_the_follow_up(tiny_model_dir, scripted):
    model, script = scripted
    cfg = rollout_config(tiny_model_dir, "sampling.max_new_tokens=16")
    result, sessions = await _two_turn_rollouts(cfg, model=model)
    tokenizer = load_tokenizer(tiny_model_dir)

    stats = result.stats()
    assert stats["completed"] == 2 and stats["concat_breaks"] == 0
    assert stats["trajectories"] == 2  # one per rollout
    for outcome in result.outcomes:
        (t,) = outcome.trajectories
        first, second = sessions[t.session_id].interactions
        # The first answer ends with <|im_end|> (eos), the second is cut at max_tokens.
        assert (first.output_ids, first.finish_reason) == (script, "stop")
        assert (second.output_ids, second.finish_reason) == (script[:3], "length")
        assert t.input_ids.tolist() == second.prompt_ids + second.output_ids
        _check_sample(t, [first, second])
        gap = t.input_ids[len(first.prompt_ids) + len(first.output_ids) : len(second.prompt_ids)]
        assert tokenizer.decode(gap) == (
            f"\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n"
        )
        assert t.num_sampled_tokens == len(script) + 3
        assert t.text == tokenizer.decode(t.input_ids.tolist())
        # The per-turn figures find each call from the loss mask's runs alone.
        positions = call_positions(t.loss_mask[None], torch.tensor([1]))[0]
        assert positions[t.loss_mask].tolist() == [1] * len(script) + [2] * 3


async def test_per_call_mode_gives_one_sample_per_call(tiny_model_dir, scripted):
    cfg = rollout_config(tiny_model_dir, "rollout.trajectory_mode=per_call")
    result, sessions = await _two_turn_rollouts(cfg, model=scripted[0])
    assert result.stats()["trajectories"] == 4
    for outcome in result.outcomes:
        first, second = outcome.trajectories
        calls = sessions[first.session_id].interactions
        _check_sample(first, calls[:1])
        _check_sample(second, calls[1:])
        assert first.reward == second.reward == 1.0
        assert first.group_id == second.group_id == outcome.group_id


async def test_edited_history_breaks_the_chain_and_is_counted(tiny_model_dir):
    """A second prompt that does not extend prompt + output starts a new sample."""
    result, sessions = await _two_turn_rollouts(rollout_config(tiny_model_dir), edit_history=True)
    assert result.stats()["concat_breaks"] == 2  # one per rollout
    for outcome in result.outcomes:
        first, second = outcome.trajectories
        calls = sessions[first.session_id].interactions
        _check_sample(first, calls[:1])
        _check_sample(second, calls[1:])


# ---- rewards: per-call dicts and posted over HTTP --------------------------------------


class Rewarding:
    """Two model calls, then rewards in the shape `data["reward"]` names."""

    async def run(
        self, data: dict, *, base_url: str, api_key: str, model: str, reward_key: str, **kw: Any
    ):
        async with openai_client(base_url, api_key) as client:
            a = await client.chat.completions.create(model=model, messages=QUESTION)
            b = await client.chat.completions.create(model=model, messages=QUESTION)
        shape = data["reward"]
        if shape == "dict":
            return {a.id: 1.0, b.id: 0.0}
        if shape == "dict_first_only":
            return {a.id: 1.0}
        url = base_url.removesuffix("/v1") + "/reward"  # /sessions/{id}/reward
        body = {"reward": 0.25} if shape == "posted" else {"completion_id": b.id, "reward": -1}
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {reward_key}"}) as http:
            (await http.post(url, json=body)).raise_for_status()
        return None


async def test_per_call_reward_dicts_and_posted_rewards(tiny_model_dir):
    shapes = ["dict", "dict_first_only", "posted", "posted_per_call"]
    async with start_single_process(
        startup.start(rollout_config(tiny_model_dir), train=False), Rewarding()
    ) as parts:
        result = await parts.controller.rollout_batch([{"reward": s} for s in shapes])
    by_shape = dict(zip(shapes, result.outcomes, strict=True))
    assert all(o.status == "completed" for o in result.outcomes), result.outcomes

    per_call = by_shape["dict"]
    assert [t.reward for t in per_call.trajectories] == [1.0, 0.0]  # one sample per call
    assert per_call.reward == 0.5
    first_only = by_shape["dict_first_only"]
    assert [t.reward for t in first_only.trajectories] == [1.0]
    assert first_only.export_stats["unrewarded_calls"] == 1
    posted = by_shape["posted"]
    # Both calls rendered the same prompt, so the second does not extend the first.
    assert [t.reward for t in posted.trajectories] == [0.25, 0.25]
    assert posted.reward == 0.25
    posted_per_call = by_shape["posted_per_call"]
    assert [t.reward for t in posted_per_call.trajectories] == [-1.0]
    assert result.stats()["unrewarded_calls"] == 2


# ---- prepare_batch under the staleness manager ----------------------------------------


async def _settle(workflow: Counting, started: int, timeout_s: float = 10.0) -> None:
    """Wait until `started` rollouts started and none runs, then a little longer."""
    deadline = time.monotonic() + timeout_s
    while workflow.started < started or workflow.running:
        assert time.monotonic() < deadline, (workflow.started, workflow.running)
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)  # time for a wrongly admitted rollout to start


async def test_synchronous_rl_starts_nothing_until_the_version_advances(tiny_model_dir):
    cfg = _two_groups_of_two(tiny_model_dir, max_head_offpolicyness=0)
    workflow = Counting()
    async with start_single_process(startup.start(cfg, train=False), workflow) as parts:
        controller, engine, rows = parts.controller, parts.engine, repeat_row(q=1)
        first = await controller.prepare_batch(rows)
        assert [len(g) for g in groups_of(first)] == [2, 2]
        await _settle(workflow, 4)
        assert workflow.started == 4
        staleness = controller.staleness
        assert (staleness.accepted, staleness.running, staleness.rejected) == (4, 0, 0)
        assert staleness.capacity(engine.version) == 0

        await engine.update_weights(load_model(tiny_model_dir).state_dict(), version=1)
        controller.notify_version()
        second = await controller.prepare_batch(rows)
        await _settle(workflow, 8)
        assert workflow.started == 8
        assert (staleness.accepted, staleness.running) == (8, 0)
    assert _sampled_versions(first) == {0}
    assert _sampled_versions(second) == {1}  # every token from the new policy


async def test_one_step_off_policy_runs_one_batch_ahead(tiny_model_dir):
    cfg = _two_groups_of_two(tiny_model_dir, max_head_offpolicyness=1)
    workflow = Counting()
    async with start_single_process(startup.start(cfg, train=False), workflow) as parts:
        controller, engine, rows = parts.controller, parts.engine, repeat_row(q=1)
        first = await controller.prepare_batch(rows)
        await _settle(workflow, 8)  # the next batch is produced without a version bump
        assert workflow.started == 8
        assert controller.staleness.capacity(engine.version) == 0
        # Nothing can start at capacity 0: the next batch is the one produced ahead.
        second = await controller.prepare_batch(rows)
        assert workflow.started == 8

        await engine.update_weights(load_model(tiny_model_dir).state_dict(), version=1)
        controller.notify_version()
        third = await controller.prepare_batch(rows)
        await _settle(workflow, 12)
        assert workflow.started == 12
        assert controller.staleness.accepted == 12
    assert _sampled_versions(first) == _sampled_versions(second) == {0}  # second: 1 stale
    assert _sampled_versions(third) == {1}


async def test_max_concurrent_rollouts_is_never_exceeded(tiny_model_dir):
    cfg = rollout_config(
        tiny_model_dir,
        "rollout.group_size=2",
        "rollout.batch_size=4",
        "rollout.max_head_offpolicyness=2",
        "rollout.max_concurrent_rollouts=4",
    )
    workflow = Counting()
    async with start_single_process(startup.start(cfg, train=False), workflow) as parts:
        rows = repeat_row(q=1)
        for _ in range(3):
            result = await parts.controller.prepare_batch(rows)
            assert len(groups_of(result)) == 4
        assert workflow.peak == 4  # the limit, reached but never passed

    workflow = Counting()
    cfg.rollout.max_concurrent_rollouts = 3
    async with start_single_process(startup.start(cfg, train=False), workflow) as parts:
        await parts.controller.rollout_batch([{}] * 5, group_size=2)
    assert workflow.started == 10 and workflow.peak == 3


# ---- sampling overrides ----------------------------------------------------------------


class AsksForMore:
    """Asks for hot, long answers; records what its session forced."""

    def __init__(self) -> None:
        self.store: SessionStore | None = None
        self.forced: list[dict] = []

    async def run(self, data: dict, *, base_url: str, api_key: str, model: str, **kw: Any):
        self.forced.append(self.store.get(_session_id(base_url)).sampling_overrides)
        async with openai_client(base_url, api_key) as client:
            await client.chat.completions.create(
                model=model, messages=QUESTION, temperature=1.5, max_tokens=12
            )
        return 1.0


async def test_eval_overrides_win_over_what_the_agent_asks(tiny_model_dir):
    workflow = AsksForMore()
    async with start_single_process(
        startup.start(rollout_config(tiny_model_dir), train=False), workflow
    ) as parts:
        workflow.store = parts.gateway.store
        controller = parts.controller
        greedy = await controller.rollout_batch(
            [{}], group_size=4, sampling_overrides={"temperature": 0.0, "max_tokens": 5}
        )
        sampled = await controller.rollout_batch([{}], group_size=4)

    run = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}  # the run's sampling
    # evaluation: greedy, short; training sessions: the run's sampling, the agent's length
    assert workflow.forced == [{**run, "temperature": 0.0, "max_tokens": 5}] * 4 + [run] * 4
    outputs = [t.input_ids[t.loss_mask].tolist() for t in greedy.trajectories]
    assert all(1 <= len(o) <= 5 for o in outputs)
    assert all(o == outputs[0] for o in outputs)  # greedy: the same answer every time
    outputs = [t.input_ids[t.loss_mask].tolist() for t in sampled.trajectories]
    assert all(len(o) == 12 for o in outputs)
    assert len({tuple(o) for o in outputs}) > 1


async def test_eval_temperature_samples_the_held_out_rollouts(tiny_model_dir):
    # The real rollouts of `evaluate`, kept as they pass: greedy (the default) gives the
    # same replies twice; eval.temperature=1 samples them.
    from looprl.loop import evaluate
    from looprl.tasks import load_task
    from looprl.workflows.resolution import configured_workflow

    replies = {}
    for temperature in (0.0, 1.0):
        cfg = load_config(
            None,
            [
                f"model.path={tiny_model_dir}",
                "engine.dtype=float32",
                f"eval.temperature={temperature}",
                "eval.max_new_tokens=8",
                "task.eval_size=6",
            ],
        )
        task = load_task(cfg.task)
        async with start_single_process(
            startup.start(cfg, train=False), configured_workflow(cfg, task)
        ) as parts:
            results = []

            async def keep(*args, _run=parts.controller.rollout_batch, _kept=results, **kw):
                _kept.append(await _run(*args, **kw))
                return _kept[-1]

            parts.controller.rollout_batch = keep

            class Records:
                def log(self, kind, step, stats):
                    assert (kind, step, stats["rollouts"]) == ("eval", 0, 6)

            for _ in range(2):
                await evaluate(parts.controller, task.eval, cfg, Records(), step=0)
        replies[temperature] = [
            [call["reply"] for outcome in result.outcomes for call in outcome.calls]
            for result in results
        ]
    greedy, sampled = replies[0.0], replies[1.0]
    assert greedy[0] == greedy[1] and len(greedy[0]) == 6
    assert sampled[0] != sampled[1] and sampled[0] != greedy[0]
