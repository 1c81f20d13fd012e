"""The Workflow contract, how a user's agent is found, and the built-in RLVR workflow.

A workflow is user code, unchanged: anything with `async def run(self, data, **kw)` or
a plain async function `f(data, **kw)`. `kw` holds at least `base_url`, `api_key` and
`model` for an OpenAI client. It returns a reward (float), a dict mapping completion
ids (the `id` of the chat completions it received) to rewards, an EpisodeReward (such
a dict and the rollout's own reward, for multi-turn episodes), or None to reject the
rollout. Agents that report rewards over HTTP return None and POST to
`/sessions/{id}/reward`.

Owns: the protocol, `resolve_workflow` (instance | class | "module:Name" | async
function) and `RLVRWorkflow`. Knows nothing of engines or training.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

import httpx
from openai import AsyncOpenAI

from looprl.agent_process import AgentProcess
from looprl.config import ENV_WORKFLOW, VERIFIERS_WORKFLOW, Config
from looprl.rewards import FunctionReward, Reward, build_reward
from looprl.types import EpisodeReward

RewardFn = Callable[..., float]
# openai's default connect timeout (5 s) fired on a 2-core machine whose cores were busy
# (a rollout lost to APITimeoutError in the default job); rollout.timeout_s bounds a
# rollout as a whole.
CLIENT_TIMEOUT = httpx.Timeout(600.0, connect=60.0)
WorkflowResult = float | dict[str, float] | EpisodeReward | None


@runtime_checkable
class Workflow(Protocol):
    async def run(self, data: dict, **kw: Any) -> WorkflowResult: ...


class _FunctionWorkflow:
    """Adapts a plain `async def f(data, **kw)` to the Workflow protocol."""

    def __init__(self, fn: Callable[..., Awaitable[WorkflowResult]]):
        self.fn = fn

    async def run(self, data: dict, **kw: Any) -> WorkflowResult:
        return await self.fn(data, **kw)

    def __repr__(self) -> str:
        return f"workflow function {self.fn.__module__}.{self.fn.__qualname__}"


def import_object(spec: str, what: str = "object") -> Any:
    """Import `module:Name` (or `module.Name`), naming the spec in every error."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} {spec!r} must look like 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r}: {e}") from e
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ValueError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}") from None
    return obj


def resolve_workflow(spec: Any, kwargs: dict[str, Any] | None = None) -> Workflow:
    """Turn an instance, a class, an async function or a "module:Name" into a Workflow.

    A class is instantiated with `kwargs`; for the other forms `kwargs` must be empty.
    """
    kwargs = kwargs or {}
    if isinstance(spec, str):
        spec = import_object(spec, "workflow")
    if inspect.isclass(spec):
        if not inspect.iscoroutinefunction(getattr(spec, "run", None)):
            raise TypeError(
                f"workflow class {spec.__qualname__} needs `async def run(self, data, **kw)`"
            )
        try:
            return spec(**kwargs)
        except TypeError as e:
            raise TypeError(f"cannot build workflow {spec.__qualname__}(**{kwargs}): {e}") from e
    if kwargs:
        raise TypeError(f"workflow.kwargs={kwargs} given, but {spec!r} is not a class")
    if inspect.iscoroutinefunction(getattr(spec, "run", None)):
        return spec
    if inspect.iscoroutinefunction(spec):
        return _FunctionWorkflow(spec)
    raise TypeError(
        f"{spec!r} is not a workflow: give an object with `async def run(self, data, **kw)`,"
        " a class with one, or an async function"
    )


class RLVRWorkflow:
    """One chat turn through the `openai` client, scored by a reward function.

    `reward_fn(prompt, completion, **row) -> float` is called with the prompt text, the
    model's answer and the dataset row's fields (e.g. `answer`); it may also be a
    `looprl.rewards.Reward` (a sandboxed code run, an LLM judge), which may return None
    to reject the rollout. Sampling settings (temperature, max tokens) are left to the
    gateway, which applies the run's config.
    """

    def __init__(
        self,
        reward_fn: RewardFn | Reward | str,
        prompt_field: str = "question",
        system_prompt: str | None = None,
    ):
        if isinstance(reward_fn, str):
            reward_fn = import_object(reward_fn, "reward")
        self.reward = reward_fn if isinstance(reward_fn, Reward) else FunctionReward(reward_fn)
        self.prompt_field = prompt_field
        self.system_prompt = system_prompt

    async def run(self, data: dict, *, base_url: str, api_key: str, model: str, **kw: Any):
        if self.prompt_field not in data:
            raise KeyError(
                f"dataset row has no field {self.prompt_field!r} "
                f"(fields: {sorted(data)}); set task.prompt_field"
            )
        prompt = str(data[self.prompt_field])
        messages = chat_messages(prompt, self.system_prompt)
        # The reward's context spans the call: a group judge waits for every rollout of
        # the row that is still running before it scores them together.
        async with self.reward.rollout(data) as score:
            async with AsyncOpenAI(
                base_url=base_url, api_key=api_key, max_retries=0, timeout=CLIENT_TIMEOUT
            ) as client:
                response = await client.chat.completions.create(model=model, messages=messages)
            completion = response.choices[0].message.content or ""
            return await score(prompt, completion)


def chat_messages(prompt: str, system_prompt: str | None) -> list[dict[str, str]]:
    """The chat RLVRWorkflow sends: the prompt as the user's turn, after the system
    prompt when there is one (else the chat template's default applies)."""
    messages = [{"role": "user", "content": prompt}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def configured_workflow(cfg: Config, task, reward: Reward | None = None) -> Workflow:
    """The workflow `cfg.workflow` names: a program per rollout (subprocess mode), or
    the object at workflow.path; the built-in RLVRWorkflow gets `reward` (else the one
    `reward.type` names for `task`), the task's prompt field and system prompt unless
    workflow.kwargs set them; looprl.envs:EnvWorkflow gets the env section and the run
    dir (for env.frames_every), and looprl.envs.verifiers:VerifiersWorkflow the
    verifiers environment task.dataset names."""
    kwargs = dict(cfg.workflow.kwargs)
    if cfg.workflow.mode == "subprocess":
        return AgentProcess(cfg.workflow.command, **kwargs)
    if cfg.workflow.path == "looprl.workflow:RLVRWorkflow":
        if "reward_fn" not in kwargs:
            kwargs["reward_fn"] = reward or build_reward(cfg, task)
        kwargs.setdefault("prompt_field", task.prompt_field)
        kwargs.setdefault("system_prompt", task.system_prompt)
    if cfg.workflow.path == ENV_WORKFLOW:  # the env section, unless workflow.kwargs say
        kwargs = {**cfg.env.model_dump(), "run_dir": str(cfg.run_dir), **kwargs}
    if cfg.workflow.path == VERIFIERS_WORKFLOW:
        kwargs = {"env_id": cfg.task.dataset, "env_kwargs": cfg.task.dataset_kwargs, **kwargs}
    return resolve_workflow(cfg.workflow.path, kwargs)
