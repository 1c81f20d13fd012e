"""Small environments for the env tests, built by `env.name=tests.support.envs:NAME`.

`GuessEnv` is written the way SkyRL-Gym text environments are: a class whose step takes
the model's text and returns the next observation, a reward and done. `Misbehaving`
crashes its worker, hangs or raises on the seeds it is told, so tests with a random
model still know which episode fails how.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import time

from looprl.envs.base import InvalidAction


class GuessEnv:
    """Guess a number from 1 to `high`: a hint per wrong guess, reward 1 for the right
    one, -0.25 per wrong one; a reply without a number is rejected."""

    def __init__(self, high: int = 4):
        self.high = high
        self.target = 0

    def reset(self, seed: int, options: dict | None = None) -> str:
        self.target = random.Random(seed).randint(1, self.high)
        return f"Guess my number from 1 to {self.high}. Reply with the number."

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        match = re.search(r"\d+", action_text)
        if match is None:
            raise InvalidAction(
                f"no number in your reply; reply with a number from 1 to {self.high}"
            )
        guess = int(match.group())
        if guess == self.target:
            return "Right!", 1.0, True, {"success": True}
        hint = "higher" if guess < self.target else "lower"
        return f"{guess} is wrong, go {hint}.", -0.25, False, {"guess": guess}


class AsyncGuessEnv(GuessEnv):
    """GuessEnv with async methods (the contract allows either)."""

    async def reset(self, seed: int, options: dict | None = None) -> str:
        await asyncio.sleep(0)
        return GuessEnv.reset(self, seed, options)

    async def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        await asyncio.sleep(0)
        return GuessEnv.step(self, action_text)


class CountEnv:
    """Deterministic: reward 1 per step, done after `length` steps; the observation
    names the step. Any reply is an action."""

    def __init__(self, length: int = 3, crash_at_step: int | None = None):
        self.length, self.crash_at_step = length, crash_at_step
        self.steps = 0

    def reset(self, seed: int, options: dict | None = None) -> str:
        self.steps = 0
        return f"seed {seed}, step 0"

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        self.steps += 1
        if action_text == "crash":
            os._exit(3)
        if action_text == "hang":
            time.sleep(3600)
        if action_text == "slow":
            time.sleep(1.0)
        if action_text == "spawn":  # a process of the env's own, left running
            child = subprocess.Popen(["sleep", "1000"])
            return f"child {child.pid}", 1.0, False, {}
        if action_text == "hang, deaf to SIGTERM":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(3600)
        if action_text == "long":  # an observation far larger than a socket's buffer
            return "x" * (3 << 20), 1.0, False, {}
        if action_text == "raise":
            raise RuntimeError("the env broke on purpose")
        if action_text == "nan":
            return "step", float("nan"), False, {}
        if action_text == "bad":
            return "not a 4-tuple"
        if action_text == "random":  # not deterministic in its seed
            return f"step {self.steps}, {random.random()}", 1.0, False, {}
        return f"step {self.steps}", 1.0, self.steps >= self.length, {}


class SummitEnv(CountEnv):
    """CountEnv that says on every step whether the episode succeeded so far: only once
    `length` steps are done (the summit), whatever reward the steps before earned."""

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        observation, reward, done, info = super().step(action_text)
        return observation, reward, done, {**info, "success": self.steps >= self.length}


class Misbehaving(CountEnv):
    """CountEnv whose first step crashes the worker (seed % 4 == 1), hangs (== 2) or
    raises (== 3), whatever the model says."""

    def reset(self, seed: int, options: dict | None = None) -> str:
        self.mode = {1: "crash", 2: "hang", 3: "raise"}.get(seed % 4)
        return super().reset(seed, options)

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        return super().step(self.mode or "ok")


def broken_factory(**kwargs):
    raise RuntimeError("cannot build this env")
