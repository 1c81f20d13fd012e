"""EnvWorkflow: one multi-turn workflow that plays any environment through the gateway.

Per turn: the observation is the user's message (after `system_prompt`, and the last
`history_turns` turns), the model's reply is the action text, and the env's step reward
is credited to the chat completion that produced the reply. A reply the env rejects
(InvalidAction) earns `invalid_action_reward`, and its message, then the unchanged
observation, is the next turn's prompt (or the episode ends: `end_on_invalid_action`).
The episode ends when the env says done or after `max_turns` replies.

Credit: reply t gets its return-to-go G_t = r_t + discount * G_{t+1} (the last reply's
is its own reward), and r_t itself goes along (`EpisodeReward.per_step`, for
`train.credit=gae`); the rollout's reward is the episode return sum_t r_t, which is what
its group's statistics and filtering see. It returns an EpisodeReward with `success`:
the env's own `info["success"]` of its last accepted step (so an env that reports it on
every step, as the Gymnasium adapters do, judges an episode that max_turns cut short),
else episode return > 0 (what held-out accuracy counts).

Frames (env.frames_every = N > 0): one episode in N is reset with `record=True` and its
frames are saved when it ends, in `RUN_DIR/frames/<session_id>.gif` (runs/paths.py), the
session id being the gateway's (base_url ends /sessions/{id}/v1), which the episode's
rows in the trajectory files hold.

Owns: the turn loop and the credit. The envs run in worker processes (workers.py), which
start when the workflow is built (so a wrong env.name fails at once) and stop at
`close()`.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from looprl.config import EnvConfig
from looprl.envs.base import InvalidAction
from looprl.envs.workers import EnvWorkers
from looprl.runs.paths import frame_file
from looprl.types import EpisodeReward
from looprl.workflows.client import session_client

log = logging.getLogger(__name__)


def returns_to_go(rewards: list[float], discount: float) -> list[float]:
    """G_t = r_t + discount * G_{t+1}, for each step t.

    >>> returns_to_go([0.0, -0.1, 1.0], 0.5)
    [0.2, 0.4, 1.0]
    """
    returns, future = [], 0.0
    for reward in reversed(rewards):
        future = reward + discount * future
        returns.append(future)
    return returns[::-1]


class EnvWorkflow:
    """Plays episodes of `name` (see EnvConfig in looprl/config/task.py for every field); a
    dataset row is `{"seed": N}` (task.name=env), with optional reset `options`.
    `frames_dir` is where env.frames_every saves frames (the run's, which
    configured_workflow passes)."""

    def __init__(self, frames_dir: str | None = None, **fields: Any):
        self.cfg = EnvConfig(**fields)
        if not self.cfg.name:
            raise ValueError("EnvWorkflow needs env.name, e.g. env.name=gymnasium:FrozenLake-v1")
        if self.cfg.frames_every and frames_dir is None:
            raise ValueError(
                f"env.frames_every={self.cfg.frames_every} saves frames in the run dir: "
                "give EnvWorkflow(frames_dir=...), or set env.frames_every=0"
            )
        self.frames_dir = frames_dir
        self.episodes = itertools.count()  # episodes begun, for env.frames_every
        max_frames = self.cfg.frames_max_per_episode if self.cfg.frames_every else 0
        self.workers = EnvWorkers(
            self.cfg.name, self.cfg.kwargs, self.cfg.workers, self.cfg.step_timeout_s, max_frames
        )
        self.workers.start()
        if self.cfg.frames_every:
            log.info(
                "Saving the frames of one env episode in %d to %s/<session_id>.gif",
                self.cfg.frames_every,
                frames_dir,
            )

    def __repr__(self) -> str:
        return f"EnvWorkflow({self.cfg.name})"

    async def run(
        self, data: dict, *, base_url: str, api_key: str, model: str, **kw: Any
    ) -> EpisodeReward:
        if "seed" not in data:
            raise KeyError(f"an env episode's row needs a 'seed' (fields: {sorted(data)})")
        cfg = self.cfg
        turns: list[tuple[str, str]] = []  # (prompt shown, reply)
        credit: list[tuple[str, float]] = []  # (completion id, step reward)
        success = None
        async with (
            self.workers.episode() as env,
            session_client(base_url, api_key) as client,
        ):
            every = cfg.frames_every
            record = bool(every) and next(self.episodes) % every == 0
            observation = await env.reset(int(data["seed"]), data.get("options"), record=record)
            prompt = observation
            for _ in range(cfg.max_turns):
                response = await client.chat.completions.create(
                    model=model, messages=self.messages(turns, prompt)
                )
                reply = response.choices[0].message.content or ""
                turns.append((prompt, reply))
                try:
                    observation, reward, done, info = await env.step(reply)
                    prompt = observation
                    success = info.get("success", success)
                except InvalidAction as e:
                    reward, done, info = cfg.invalid_action_reward, cfg.end_on_invalid_action, {}
                    prompt = f"{e}\n\n{observation}"
                credit.append((response.id, reward))
                if done:
                    break
            if record:
                session_id = base_url.rstrip("/").split("/")[-2]  # .../sessions/{id}/v1
                await env.save_frames(frame_file(self.frames_dir, session_id))
        total = sum(reward for _, reward in credit)
        to_go = returns_to_go([reward for _, reward in credit], cfg.discount)
        return EpisodeReward(
            per_call={cid: g for (cid, _), g in zip(credit, to_go, strict=True)},
            total=total,
            success=total > 0 if success is None else bool(success),
            per_step=dict(credit),
        )

    def messages(self, turns: list[tuple[str, str]], prompt: str) -> list[dict[str, str]]:
        """The chat of one turn: system prompt, the last history_turns turns, `prompt`."""
        messages = []
        if self.cfg.system_prompt is not None:
            messages.append({"role": "system", "content": self.cfg.system_prompt})
        kept = turns[-self.cfg.history_turns :] if self.cfg.history_turns else []
        for shown, reply in kept:
            messages += [
                {"role": "user", "content": shown},
                {"role": "assistant", "content": reply},
            ]
        messages.append({"role": "user", "content": prompt})
        return messages

    def close(self) -> None:
        """Stop the env workers (idempotent)."""
        self.workers.close()
