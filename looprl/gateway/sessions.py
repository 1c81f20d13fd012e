"""Gateway sessions: the calls and the reward of one rollout.

Owns: a Session (its id, its two secret keys, every model call recorded on it, the
reward an agent posted over HTTP) and the SessionStore the gateway looks sessions up
in. Does not own HTTP (app.py) or how calls become training samples (trajectory.py).

Sessions live on one event loop: the store is a plain dict, and nothing here awaits,
so no lock is needed, but for one thing: prompts are built in worker threads
(prompt_lanes.py), which decode a session's calls into `call_texts` holding its
`prompt_lock`.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from looprl.types import Interaction, SamplingParams

Reward = float | dict[str, float]

# Request fields a session may force, and the SamplingParams field each one sets.
OVERRIDABLE = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_tokens": "max_new_tokens",
    "stop": "stop",
    "seed": "seed",
}


@dataclass
class Session:
    """One rollout's view of the gateway.

    `api_key` is what model calls need, `reward_key` what posting the reward needs: two
    keys, so that code an agent hands the model-call key to (a sub-agent, a tool the
    model drives) cannot post the rollout's reward with it, and the reward key cannot
    call the model.
    `interactions` holds one entry per choice of every call, in the order the calls
    finished (the choices of one call in index order, sharing its completion id).
    `reward` is what the agent posted to `/sessions/{id}/reward`: a float for the
    whole rollout, or {completion_id: reward} for per-call credit.
    `sampling_overrides` holds request fields (keys of OVERRIDABLE) that win over what
    the agent sends, e.g. {"temperature": 0.0} for greedy evaluation.
    `sampled_texts` lets the gateway render an assistant message carrying tool calls it
    returned as the exact text the model sampled (so prompts keep extending).
    """

    id: str
    api_key: str
    reward_key: str
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    interactions: list[Interaction] = field(default_factory=list)
    reward: Reward | None = None
    sampled_texts: dict[str, str] = field(default_factory=dict)  # tool call id -> its choice's text
    call_texts: list[str] = field(default_factory=list)  # decoded prompt + output, per interaction
    prompt_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # call_texts'
    tool_call_errors: int = 0  # choices whose tool call could not be parsed
    # /v1/responses answers by id: the conversation a previous_response_id continues
    responses: dict[str, list[dict]] = field(default_factory=dict)
    closed: bool = False
    created_s: float = field(default_factory=time.time)

    def completion_ids(self) -> set[str]:
        return {it.completion_id for it in self.interactions}

    def post_reward(self, reward: Reward) -> None:
        """Record a posted reward: a float replaces everything, a dict adds per-call rewards.

        Raises ValueError naming a completion id this session never returned.
        """
        if isinstance(reward, dict):
            unknown = sorted(set(reward) - self.completion_ids())
            if unknown:
                raise ValueError(
                    f"completion id {unknown[0]!r} was not returned by session {self.id}; "
                    "post rewards for the `id` of a response from this session"
                )
            merged = self.reward if isinstance(self.reward, dict) else {}
            self.reward = {**merged, **reward}
        else:
            self.reward = float(reward)


class SessionStore:
    """The open sessions, by id. `close` removes a session; later calls to it get 404."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, sampling_overrides: dict[str, Any] | None = None) -> Session:
        """A new session; raises ValueError naming a bad field of `sampling_overrides`."""
        overrides = dict(sampling_overrides or {})
        SamplingParams(**sampling_fields(overrides, "sampling_overrides"))
        session = Session(
            id=secrets.token_hex(8),
            api_key=secrets.token_urlsafe(24),
            reward_key=secrets.token_urlsafe(24),
            sampling_overrides=overrides,
        )
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def close(self, session_id: str) -> Session:
        """Remove and return a session; calls still in flight on it are not recorded."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            raise KeyError(f"session {session_id!r} is not open (never opened or already closed)")
        session.closed = True
        return session


def sampling_fields(request_fields: dict[str, Any], where: str) -> dict[str, Any]:
    """Request fields (OpenAI names, None meaning unset) as SamplingParams fields."""
    unknown = sorted(set(request_fields) - set(OVERRIDABLE))
    if unknown:
        raise ValueError(
            f"{where} has unknown field {unknown[0]!r}; known: {', '.join(OVERRIDABLE)}"
        )
    return {
        OVERRIDABLE[name]: [value] if name == "stop" and isinstance(value, str) else value
        for name, value in request_fields.items()
        if value is not None
    }
