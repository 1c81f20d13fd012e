"""sampling: how rollouts are sampled; gateway: where it listens and its per-request limits."""

from __future__ import annotations

from pydantic import Field

from looprl.config.base import Section


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0, description="Sampling temperature for rollouts.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    top_k: int = Field(0, ge=0, description="Top-k truncation; 0 disables it.")
    max_new_tokens: int = Field(48, ge=1, description="Most tokens generated per call.")


class LimitsConfig(Section):
    """What one request may ask of the gateway; beyond them it gets a 400 or 413."""

    max_request_bytes: int = Field(
        4 * 2**20, ge=1024, description="Largest request body, in bytes (413 beyond)."
    )
    max_json_depth: int = Field(
        64, ge=2, le=500, description="Deepest JSON nesting in a body or tool-call arguments."
    )
    max_messages: int = Field(2048, ge=1, description="Most chat messages in one request.")
    max_stop_strings: int = Field(16, ge=0, description="Most stop strings in one request.")
    max_stop_chars: int = Field(256, ge=1, description="Longest stop string, in characters.")
    request_token_budget: int = Field(
        65536,
        ge=1,
        description="Most output tokens one request may ask for: n x max_tokens (after "
        "max_tokens is clamped to the context left after the prompt).",
    )


class GatewayConfig(Section):
    host: str = Field("127.0.0.1", description="Address the gateway binds to.")
    port: int = Field(0, ge=0, le=65535, description="Port; 0 picks a free one.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
