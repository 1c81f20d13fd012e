"""verifiers environments (Prime Intellect's `verifiers` 0.3): `env.name=verifiers:ENV_ID`.

A verifiers environment brings its own dataset, rollout logic and rubric, so it is not a
reset/step env: looprl takes its rows as the task and lets `VerifiersWorkflow` run its
rollouts against the gateway (`env.name=verifiers:ENV_ID env.kwargs=K` stands for
task.name=verifiers task.dataset=ENV_ID task.dataset_kwargs=K and this workflow).

- Loading: `verifiers.load_environment(ENV_ID, **kwargs)` imports the module ENV_ID
  names (dashes read as underscores; a dotted path works) and calls its
  `load_environment(**kwargs)`; once per process (`load_environment` below), shared by the
  rows and the workflow.
- Rows: train is the env's `dataset`, held out the first task.eval_size rows of its
  `eval_dataset`; without one, task.eval_size rows of `dataset` (shuffled with task.seed)
  are held out and train never sees them. A row is the env's own (`prompt` as chat
  messages, `answer`, `info`, `example_id`, ...), JSON-ready.
- A rollout: the env's `rollout(row, client, model)` with a verifiers client around the
  session's AsyncOpenAI (single-turn, multi-turn and tool envs alike), then its
  `rubric.score_rollout(state)`: the weighted sum of its reward functions is the
  rollout's reward, and every model call of the rollout is a sample with that reward (as
  verifiers' own group scoring sets each trajectory step's). `success` is a reward of at
  least the env's `pass_threshold` (verifiers' pass@k threshold, 0.5 by default).
- Sampling is the run's (sampling.*, applied by the gateway), not the env's
  `sampling_args`.

Errors end only their rollout (the rollout layer counts them by type): an error the
rollout recorded (e.g. EmptyModelResponseError, the model said nothing) is raised as
EnvFailed naming it; anything the env raises is raised as it is. verifiers' Rubric catches
a reward function's exception itself: it logs "Error calling reward function" and scores
that function 0. A rubric with group reward functions (scoring a group together) is
refused at load: looprl scores each rollout alone.
"""

from __future__ import annotations

import functools
import json
import signal
from typing import Any

from looprl.config import TaskConfig
from looprl.envs.base import ENVS_EXTRA, EnvFailed
from looprl.types import EpisodeReward
from looprl.workflows.client import session_client


def load_environment(env_id: str, kwargs: dict[str, Any]):
    """The verifiers environment `env_id` built with `kwargs`, loaded once per process."""
    return _load(env_id, json.dumps(kwargs, sort_keys=True))


@functools.cache
def _load(env_id: str, kwargs_json: str):
    try:
        import verifiers
    except ImportError as e:
        raise ImportError(
            f"the verifiers environment {env_id!r} needs verifiers: {ENVS_EXTRA} ({e})"
        ) from e
    kwargs = json.loads(kwargs_json)
    # A verifiers Environment installs SIGINT/SIGTERM handlers when built (tear down, then
    # exit); looprl's own (finish the step, save, stop) are put back.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        env = verifiers.load_environment(env_id, **kwargs)
    except (ValueError, RuntimeError) as e:
        cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
        raise ValueError(
            f"cannot load the verifiers environment {env_id!r} with kwargs {kwargs}: {e}{cause}"
        ) from e
    finally:
        for sig, handler in handlers.items():
            if signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
    if env.requires_group_rollouts:
        raise ValueError(
            f"the verifiers environment {env_id!r} has group reward functions, which score "
            "a group of rollouts together; looprl scores each rollout alone (its group's "
            "advantages come after), so give it per-rollout reward functions"
        )
    return env


def make_splits(cfg: TaskConfig) -> tuple[list[dict], list[dict]]:
    """(train, held_out) rows of the verifiers environment `task.dataset` (see the module
    docstring)."""
    env = load_environment(cfg.dataset, cfg.dataset_kwargs)
    dataset, eval_dataset = env.build_dataset(), env.build_eval_dataset()
    if dataset is None:
        raise ValueError(
            f"the verifiers environment {cfg.dataset!r} has no dataset to train on (only an "
            "eval_dataset)"
        )
    if eval_dataset is None:
        if len(dataset) <= cfg.eval_size:
            raise ValueError(
                f"the verifiers environment {cfg.dataset!r} has no eval_dataset, and its "
                f"dataset's {len(dataset)} rows leave none to train on after task.eval_size="
                f"{cfg.eval_size} held out; lower task.eval_size"
            )
        shuffled = dataset.shuffle(seed=cfg.seed)
        eval_dataset = shuffled.select(range(cfg.eval_size))
        dataset = shuffled.select(range(cfg.eval_size, len(shuffled)))
    held_out = eval_dataset.select(range(min(cfg.eval_size, len(eval_dataset))))
    return _rows(dataset, cfg.dataset), _rows(held_out, cfg.dataset)


def _rows(dataset, env_id: str) -> list[dict]:
    rows = dataset.to_list()
    for column in dataset.column_names:
        try:
            json.dumps([row[column] for row in rows])
        except TypeError as e:
            raise ValueError(
                f"the verifiers environment {env_id!r} has a column {column!r} that is not "
                f"JSON ({e}); looprl keeps rows in its rollout queue and trajectory files"
            ) from None
    return rows


class VerifiersWorkflow:
    """Runs rollouts of the verifiers environment `env_id` (built with `env_kwargs`) on
    its rows, each scored by the env's rubric (see the module docstring)."""

    def __init__(self, env_id: str, env_kwargs: dict[str, Any] | None = None):
        self.env_id = env_id
        self.env = load_environment(env_id, env_kwargs or {})

    def __repr__(self) -> str:
        return f"VerifiersWorkflow({self.env_id})"

    async def run(
        self, data: dict, *, base_url: str, api_key: str, model: str, **kw: Any
    ) -> EpisodeReward:
        from verifiers.legacy.clients import OpenAIChatCompletionsClient
        from verifiers.legacy.utils.error_utils import ErrorChain

        async with session_client(base_url, api_key) as client:
            state = await self.env.rollout(data, OpenAIChatCompletionsClient(client), model)
            try:
                if state["error"] is not None:
                    raise EnvFailed(
                        f"verifiers environment {self.env_id!r}: the rollout ended with "
                        f"{ErrorChain(state['error'])!r}"
                    )
                await self.env.rubric.score_rollout(state)
            finally:
                await self.env.rubric.cleanup(state)
        reward = float(state["reward"])
        return EpisodeReward(
            per_call={step["response"].id: reward for step in state["trajectory"]},
            total=reward,
            success=reward >= self.env.pass_threshold,
        )
