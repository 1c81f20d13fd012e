"""engine.pause_while_training: decided once at start, and what the loop's train step
does with it, on the real tiny engine and trainer of `start_single_process`."""

from __future__ import annotations

import asyncio
import logging

import pytest

from looprl import startup
from looprl.config import load_config
from looprl.loop import train_step
from looprl.scheduling.parts import pause_engine_while_training
from looprl.scheduling.single_process import start_single_process
from looprl.types import SamplingParams
from tests.support.batches import toy_batch
from tests.support.rollouts import Counting, rollout_config

SEPARATE = "a server at engine.url http://10.0.0.5:8000"


@pytest.mark.parametrize(
    ("setting", "separate", "paused"),
    [
        ("auto", None, True),  # sharing devices or cores: the trainer gets them
        ("auto", SEPARATE, False),  # the engine runs elsewhere: it keeps generating
        ("always", SEPARATE, True),
        ("never", None, False),
    ],
)
def test_the_decision_and_its_log_line(setting, separate, paused, caplog):
    cfg = load_config(None, [f"engine.pause_while_training={setting}"])
    with caplog.at_level(logging.INFO, logger="looprl.scheduling.parts"):
        assert pause_engine_while_training(cfg, separate) is paused
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("The engine pauses" if paused else "The engine keeps generating")
    if separate is not None and not paused:
        assert SEPARATE in line


def test_a_setting_that_is_not_one_names_the_field():
    with pytest.raises(Exception, match="engine.pause_while_training"):
        load_config(None, ["engine.pause_while_training=sometimes"])


class GeneratesDuringItsStep:
    """The real trainer handle, whose step first waits for a generation on the engine
    (at most `wait_s`): it finishes only if the engine serves while the trainer steps."""

    def __init__(self, handle, engine, prompt: list[int], wait_s: float) -> None:
        self.handle, self.engine, self.prompt, self.wait_s = handle, engine, prompt, wait_s
        self.served: bool | None = None

    async def train_step(self, batch):
        generation = self.engine.generate(self.prompt, SamplingParams(max_new_tokens=3))
        try:
            await asyncio.wait_for(generation, self.wait_s)
            self.served = True
        except TimeoutError:
            self.served = False
        return await self.handle.train_step(batch)

    async def push_weights(self) -> None:
        await self.handle.push_weights()


@pytest.mark.parametrize(("setting", "served"), [("auto", False), ("never", True)])
async def test_the_engine_serves_during_the_step_only_when_not_paused(
    tiny_model_dir, setting, served
):
    cfg = rollout_config(tiny_model_dir, f"engine.pause_while_training={setting}")
    setup = startup.start(cfg)
    async with start_single_process(setup, Counting(), train=True) as parts:
        assert parts.pause_engine is (setting == "auto")  # one process, one CPU: shared
        prompt = setup.model.tokenizer.encode("2 + 2 =")
        handle = GeneratesDuringItsStep(parts.trainer, parts.engine, prompt, 5 if served else 0.5)
        stats = await train_step(
            handle,
            toy_batch([(8, 4, 1.0, "a"), (8, 4, 0.0, "a")]),
            parts.engine,
            pause=parts.pause_engine,
        )
        assert handle.served is served
        assert parts.engine.version == 1 and "weight_sync_s" in stats
        # Paused or not, the engine serves after the step, under the new weights.
        after = await parts.engine.generate(prompt, SamplingParams(max_new_tokens=2))
        assert after.versions == [1, 1]
