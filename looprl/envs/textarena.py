"""Single-player TextArena games: `env.name=textarena:ID` (e.g. GuessTheNumber-v0).

`textarena.make(ID, **kwargs)` builds the game with its own wrappers; the observation is
what the game shows its player (with the default wrappers, the rules and every move and
answer so far, so `env.history_turns: 0` fits). TextArena's own rules hold: a move it
rejects (a guess without `[brackets]`, one out of range) comes back to the model as
InvalidAction with the game's reason while its error allowance lasts, then ends the game
with the game's reward. The reward is the game's, given when the game ends (GuessTheNumber:
1 for the right number, else how close the last guess was); `success` is a reward of 1.
"""

from __future__ import annotations

from typing import Any

import textarena

from looprl.envs.base import InvalidAction, StepResult
from looprl.envs.gymnasium import plain


class TextArenaEnv:
    def __init__(self, env_id: str, **kwargs: Any):
        self.env_id, self.kwargs = env_id, kwargs
        self.env = textarena.make(env_id, **kwargs)  # an unknown ID fails here

    def reset(self, seed: int, options: dict | None = None) -> str:
        if options:
            raise ValueError(f"textarena:{self.env_id} takes no reset options, got {options}")
        self.env = textarena.make(self.env_id, **self.kwargs)  # wrappers keep a history
        self.env.reset(num_players=1, seed=seed)
        _, observation = self.env.get_observation()
        return observation

    def step(self, action_text: str) -> StepResult:
        done, info = self.env.step(action_text)
        state = self.env.state
        if not done and state.error_count > 0:  # rejected, within the error allowance
            raise InvalidAction(state.logs[-1][1])
        if done:
            rewards, game_info = self.env.close()
            reward = float(rewards[0])
            return "", reward, True, {**plain(game_info[0]), "success": reward >= 1.0}
        _, observation = self.env.get_observation()
        return observation, 0.0, False, plain(info)


def make(env_id: str, **kwargs: Any) -> TextArenaEnv:
    return TextArenaEnv(env_id, **kwargs)
