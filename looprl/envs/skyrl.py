"""SkyRL-Gym text environments: `env.name=skyrl:ID` (an env registered with skyrl_gym,
e.g. gsm8k_multi_turn) or `env.name=skyrl:package.module:Class` (your own class written
to SkyRL-Gym's BaseTextEnv API).

That API: an env per episode, built with the episode's `extras` (SkyRL puts a dataset
row's reward_spec and extra_info there); `init(prompt: chat messages) -> (messages,
metadata)`; `step(action: str) -> {observations: chat messages, reward, done,
metadata}`; `close()`.

Behind looprl's contract: `reset` builds a fresh env with `extras` (env.kwargs' `extras`,
updated by the reset options' `extras`) and the other env.kwargs, and calls its `init`
with the prompt: the options' `prompt`, else env.kwargs' `prompt` (chat messages, or a
text for the user's turn). The observation is the messages' contents, joined by blank
lines; so is each step's (empty when the env gives none). The step's reward and done are
the env's, its metadata the info; the env is closed when done. SkyRL-Gym envs take no
seed: an episode is its prompt and extras.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from looprl.envs.base import ENVS_EXTRA, StepResult

Messages = list[dict[str, Any]]


def as_text(messages: Messages) -> str:
    """The contents of chat `messages`, joined by blank lines.

    >>> as_text([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}])
    'Be brief.\\n\\n2+2?'
    """
    return "\n\n".join(message["content"] for message in messages)


class SkyRLEnv:
    """One SkyRL-Gym text env per episode, built by `factory(extras=..., **kwargs)`."""

    def __init__(
        self,
        name: str,
        factory: Callable[..., Any],
        prompt: Messages | str | None = None,
        extras: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        self.name, self.factory, self.kwargs = name, factory, kwargs
        self.prompt, self.extras = prompt, dict(extras or {})
        self.env = None

    def reset(self, seed: int, options: dict | None = None) -> str:
        options = dict(options or {})
        prompt = options.pop("prompt", self.prompt)
        extras = {**self.extras, **options.pop("extras", {})}
        if options:
            raise ValueError(
                f"skyrl:{self.name} reads the reset options 'prompt' and 'extras', not "
                f"{sorted(options)}"
            )
        if prompt is None:
            raise ValueError(
                f"skyrl:{self.name} needs a prompt for init(): env.kwargs.prompt, or the "
                "row's options.prompt"
            )
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        self.close()
        self.env = self.factory(extras=extras, **self.kwargs)
        messages, _ = self.env.init(prompt)
        return as_text(messages)

    def step(self, action_text: str) -> StepResult:
        output = self.env.step(action_text)
        done = bool(output["done"])
        if done:
            self.close()
        metadata = output.get("metadata") or {}  # Optional in SkyRL-Gym's EnvStepOutput
        return as_text(output["observations"]), float(output["reward"]), done, metadata

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


def make(name: str, **kwargs: Any) -> SkyRLEnv:
    """`name` is a skyrl_gym registry ID, or `package.module:Class` for your own."""
    if ":" in name:
        from looprl.workflows.imports import import_object

        return SkyRLEnv(name, import_object(name, "env.name"), **kwargs)
    try:
        import skyrl_gym
    except ImportError as e:
        raise ImportError(f"env.name=skyrl:{name} needs skyrl-gym: {ENVS_EXTRA} ({e})") from e
    if name not in skyrl_gym.registry:
        raise ValueError(
            f"env.name=skyrl:{name}: skyrl_gym has no env {name!r} (it has "
            f"{', '.join(sorted(skyrl_gym.registry))}); or give your class as "
            "skyrl:package.module:Class"
        )
    return SkyRLEnv(name, functools.partial(skyrl_gym.make, name), **kwargs)
