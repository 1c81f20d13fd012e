"""The Engine protocol: what the gateway and the trainer need from an inference engine.

An engine turns prompt token ids into sampled token ids with logprobs and the policy
version of every token, and accepts new weights. It knows nothing of sessions, chat
templates or training.
"""

from __future__ import annotations

from typing import Protocol

import torch

from looprl.types import Generation, SamplingParams


class EngineError(RuntimeError):
    """The engine cannot serve a request (bad prompt, engine stopped, engine died)."""


class Engine(Protocol):
    @property
    def version(self) -> int:
        """Policy version of the weights currently loaded."""
        ...

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        """Sample a continuation of `prompt_ids`; concurrent calls are batched."""
        ...

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights; tokens sampled afterwards carry `version`."""
        ...

    async def pause(self) -> None:
        """Stop decoding at the next token boundary; in-flight requests wait."""
        ...

    async def resume(self) -> None:
        """Continue decoding after `pause`."""
        ...

    async def stop(self) -> None:
        """Release what the engine holds (its batcher, or the server it launched and the
        weight files written for it); requests still unanswered fail with EngineError."""
        ...
