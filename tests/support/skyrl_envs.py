"""A SkyRL-Gym text environment for the adapter tests, built by
`env.name=skyrl:tests.support.skyrl_envs:VowelEnv`: a subclass of skyrl_gym's BaseTextEnv,
written as SkyRL-Gym's own envs are (extras in, chat messages out)."""

from __future__ import annotations

from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class VowelEnv(BaseTextEnv):
    """Each reply earns 0.05 per vowel in it (at most 1); the episode ends after
    `extras["turns"]` replies, and until then the user says how many are left. init puts a
    system message before the prompt."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
        super().__init__()
        self.max_turns = (extras or {}).get("turns", 2)

    def init(self, prompt):
        return [{"role": "system", "content": "Play along."}, *prompt], {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        reward = min(sum(letter in "aeiou" for letter in action.lower()) / 20, 1.0)
        done = self.turns >= self.max_turns
        left = [{"role": "user", "content": f"{self.max_turns - self.turns} turns left."}]
        return BaseTextEnvStepOutput(
            observations=[] if done else left,
            reward=reward,
            done=done,
            metadata={"turn": self.turns},
        )
