"""The environment contract, its errors, and `make_env` (a name -> an environment).

An environment is any object with

- `reset(seed: int, options: dict | None) -> str`: start an episode, return the first
  observation as text;
- `step(action_text: str) -> (observation: str, reward: float, done: bool, info: dict)`:
  play the model's reply; `info` is JSON-ready and may hold `success` (bool) at the end.

Either method may be async. An environment that cannot parse an action raises
`InvalidAction` with a message that says why and what is allowed, and leaves its state
unchanged. SkyRL-Gym text environments (init/step over chat messages) are adapted by
looprl/envs/skyrl.py.

Errors, as the workflow sees them (workers.py raises all but InvalidAction):

    InvalidAction      the env's own rule: the message goes back to the model
    EnvError           the episode ends (counted by type in the rollout stats)
      EnvCrashed       the worker process died during a call
      EnvTimedOut      a call ran past env.step_timeout_s (the worker is killed)
      EnvFailed        the env raised, or broke the contract

Owns: the protocol and the names. Imports no environment library: `make_env` imports
the adapter the name asks for, in the process that calls it (a worker).
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Protocol

StepResult = tuple[str, float, bool, dict[str, Any]]

ENVS_EXTRA = "pip install 'looprl[envs]'"


class Env(Protocol):
    def reset(self, seed: int, options: dict | None = None) -> str: ...

    def step(self, action_text: str) -> StepResult: ...


class InvalidAction(ValueError):  # noqa: N818 (the env's word for it, not an error of looprl's)
    """The action could not be parsed; the message says why and what is allowed."""


class EnvError(RuntimeError):
    """An episode that cannot go on."""


class EnvCrashed(EnvError):
    """The worker process running the environment died during a call."""


class EnvTimedOut(EnvError):
    """A call to the environment ran past env.step_timeout_s."""


class EnvFailed(EnvError):
    """The environment raised, or returned something outside the contract."""


def make_env(name: str, kwargs: dict[str, Any] | None = None) -> Env:
    """The environment `name` names, built with `kwargs`:

    - `gymnasium:ID` (e.g. `gymnasium:FrozenLake-v1`): a Gymnasium env in words
      (looprl/envs/gymnasium.py);
    - `textarena:ID` (e.g. `textarena:GuessTheNumber-v0`): a single-player TextArena game;
    - `skyrl:ID` (e.g. `skyrl:gsm8k_multi_turn`) or `skyrl:package.module:Class`: a
      SkyRL-Gym text env (looprl/envs/skyrl.py);
    - `module:factory`: your own, `factory(**kwargs)` returning an object with reset/step.

    (`verifiers:ID` is not one: a verifiers environment plays its own rollouts, see
    looprl/workflows/verifiers.py.)
    """
    kwargs = dict(kwargs or {})
    prefix, sep, rest = name.partition(":")
    if not sep or not prefix or not rest:
        raise ValueError(
            f"env.name={name!r} must look like 'gymnasium:ID', 'textarena:ID', 'skyrl:ID' or "
            "'package.module:factory'"
        )
    if prefix in ("gymnasium", "textarena", "skyrl"):
        try:
            adapter = importlib.import_module(f"looprl.envs.{prefix}")
        except ImportError as e:
            raise ImportError(f"env.name={name!r} needs {prefix}: {ENVS_EXTRA} ({e})") from e
        return adapter.make(rest, **kwargs)
    from looprl.workflows.imports import import_object  # only here: a worker stays light

    factory = import_object(name, "env.name")
    if not callable(factory):
        raise ValueError(f"env.name={name!r} is not callable; give a class or a function")
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise ValueError(
            f"env.name={name!r} could not be built with env.kwargs={kwargs}: {e}"
        ) from e


def parse_action(text: str, actions: tuple[str, ...]) -> int:
    """The index of the first word of `text` that is one of `actions` (case ignored),
    else InvalidAction naming the allowed words.

    >>> parse_action("Down, then right", ("left", "down", "right", "up"))
    1
    """
    for word in re.findall(r"[a-z0-9]+", text.lower()):
        if word in actions:
            return actions.index(word)
    shown = " ".join(text.split())[:60] or "an empty reply"
    raise InvalidAction(f"{shown!r} is not a move. Reply with one word: {or_list(actions)}.")


def or_list(words: tuple[str, ...]) -> str:
    """'a, b or c'."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
