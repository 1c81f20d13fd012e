"""The Engine protocol: what the gateway and the trainer need from an inference engine.

An engine turns prompt token ids into sampled token ids with logprobs and the policy
version of every token, and accepts new weights. It knows nothing of chat templates or
training; a request's `session` is only a routing key (a pool of replicas keeps one
session's requests on one replica, for prefix reuse).

Errors:
    EngineError              this request failed (prompt too long, bad sampling
                             options, a server's error reply); the engine serves others
    +-- EngineUnavailable    the engine cannot serve any request: stopped, died,
                             unreachable; a pool moves the request to another replica
"""

from __future__ import annotations

from typing import Protocol

import torch

from looprl.types import Generation, LoraAdapter, SamplingParams


class EngineError(RuntimeError):
    """The engine could not serve this request; the message says why and what to change."""


class EngineRequestError(EngineError):
    """This request cannot be served as asked (a prompt too long, a token id outside the
    vocabulary, ...): its own fault, failing only it. The gateway answers 400."""


class EngineUnavailable(EngineError):
    """The engine cannot serve any request: it was stopped, its process died, or it
    cannot be reached."""


class Engine(Protocol):
    @property
    def version(self) -> int:
        """Policy version of the weights currently loaded."""
        ...

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, session: str | None = None
    ) -> Generation:
        """Sample a continuation of `prompt_ids`; concurrent calls are batched.

        `session` names the conversation the request belongs to (the gateway's session
        id): a pool routes one session's requests to one replica; an engine ignores it.
        """
        ...

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights; tokens sampled afterwards carry `version`."""
        ...

    async def update_adapter(self, adapter: LoraAdapter, version: int) -> None:
        """Serve the base weights with `adapter` applied (replacing the previous adapter,
        never reloading the base); tokens sampled afterwards carry `version`."""
        ...

    async def pause(self) -> None:
        """Stop decoding at the next token boundary; in-flight requests wait."""
        ...

    async def resume(self) -> None:
        """Continue decoding after `pause`."""
        ...

    async def stop(self) -> None:
        """Release what the engine holds (its batcher, or the server it launched and the
        weight files written for it); requests still unanswered fail with
        EngineUnavailable."""
        ...
