"""The plain data that flows between looprl's parts.

Owns: sampling parameters, one engine generation, one recorded gateway call
(Interaction) and one training sample (Trajectory). Holds no behaviour beyond
validation of its own invariants; every other part imports from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

FinishReason = Literal["stop", "length", "abort"]
MIN_TEMPERATURE = 1e-5  # below it sampling is greedy (vLLM's threshold)


@dataclass
class SamplingParams:
    """How an engine samples one sequence.

    A temperature below MIN_TEMPERATURE (0 included) means greedy, as in vLLM: dividing
    logits by less overflows float32. `top_k == 0` and `top_p == 1` mean no truncation.
    Generation stops at `max_new_tokens`, at any id in `stop_token_ids` (kept in the
    output, as the policy sampled it), or when the decoded text contains one of `stop`
    (the tokens stay in the output; the gateway trims the text it returns).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


@dataclass
class Generation:
    """What an engine returns for one prompt.

    `logprobs[i]` is the log-probability of `output_ids[i]` under the distribution it
    was sampled from (after temperature, top-k and top-p; for greedy, under the
    untempered model distribution). `versions[i]` is the policy version of the weights
    that produced `output_ids[i]`. `top_logprobs[i]` lists (token id, logprob) pairs of
    the most likely tokens at step i when asked for.
    """

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"Generation has {n} output ids but {len(self.logprobs)} logprobs and "
                f"{len(self.versions)} versions; they must be equal"
            )


@dataclass(frozen=True)
class LoraAdapter:
    """One version of a LoRA adapter, as the trainer hands it to engines.

    `tensors` is keyed by the adapted module's Hugging Face name followed by
    `.lora_A.weight` (rank x in_features) or `.lora_B.weight` (out_features x rank), e.g.
    `model.layers.0.self_attn.q_proj.lora_A.weight`: no peft prefix. A module's weight
    with the adapter applied is `W + scaling * B @ A`, scaling = alpha / rank.
    """

    tensors: dict[str, torch.Tensor]
    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    def __post_init__(self) -> None:
        for module in self.modules():
            a = self.tensors[f"{module}.lora_A.weight"]
            b = self.tensors.get(f"{module}.lora_B.weight")
            if b is None or a.shape[0] != self.rank or b.shape[1] != self.rank:
                raise ValueError(
                    f"LoraAdapter {module}: lora_A {tuple(a.shape)} and lora_B "
                    f"{None if b is None else tuple(b.shape)} are not (rank, in) and (out, "
                    f"rank) for rank {self.rank}"
                )
        if len(self.tensors) != 2 * len(self.modules()):
            raise ValueError(
                "LoraAdapter.tensors holds names other than <module>.lora_A.weight / "
                f".lora_B.weight pairs: {sorted(self.tensors)[:4]}..."
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def modules(self) -> list[str]:
        """The adapted modules' names, e.g. `model.layers.0.self_attn.q_proj`."""
        return sorted(
            {k.removesuffix(".lora_A.weight") for k in self.tensors if k.endswith(".lora_A.weight")}
        )


@dataclass(frozen=True)
class SessionHandle:
    """What an agent needs to talk to one gateway session: an OpenAI base_url and key,
    and the other key that posting its reward to `{base_url without /v1}/reward` needs."""

    id: str
    base_url: str
    api_key: str
    reward_key: str


@dataclass(frozen=True)
class EpisodeReward:
    """What a multi-turn workflow may return: each chat completion's reward by its id
    (e.g. its return-to-go) and the rollout's own reward (the episode return), which
    stands for the rollout in its group's stats and filtering. `success` (None: unknown)
    is what held-out accuracy counts instead of `total >= 1`. `per_step` (optional): each
    call's own reward r_t, before any return is summed (per_call may hold returns-to-go);
    `train.credit=gae` discounts these itself (a call it does not name: its per_call
    value)."""

    per_call: dict[str, float]
    total: float
    success: bool | None = None
    per_step: dict[str, float] | None = None


@dataclass
class Interaction:
    """One model call recorded on a gateway session (one choice of one request).

    `messages` are the request's messages as the agent sent them (OpenAI format; None
    for a plain completion), `tool_calls` the calls parsed out of the reply (OpenAI
    format), `started_s` / `ended_s` unix times of the request's arrival and the reply;
    `max_tokens` the token limit the call ran under (finish_reason "length" stopped it
    there) and `requested_max_tokens` the request's own max_tokens (None: the agent
    passed none, and sampling.max_new_tokens or a session override set the limit).
    """

    completion_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    output_text: str = ""
    reward: float | None = None
    messages: list[dict] | None = None
    tool_calls: list[dict] = field(default_factory=list)
    started_s: float | None = None
    ended_s: float | None = None
    max_tokens: int | None = None
    requested_max_tokens: int | None = None

    @classmethod
    def from_generation(
        cls,
        completion_id: str,
        gen: Generation,
        text: str = "",
        *,
        messages: list[dict] | None = None,
        tool_calls: list[dict] | None = None,
        started_s: float | None = None,
        ended_s: float | None = None,
        max_tokens: int | None = None,
        requested_max_tokens: int | None = None,
    ) -> Interaction:
        return cls(
            completion_id=completion_id,
            prompt_ids=list(gen.prompt_ids),
            output_ids=list(gen.output_ids),
            logprobs=list(gen.logprobs),
            versions=list(gen.versions),
            finish_reason=gen.finish_reason,
            output_text=text,
            messages=messages,
            tool_calls=list(tool_calls or []),
            started_s=started_s,
            ended_s=ended_s,
            max_tokens=max_tokens,
            requested_max_tokens=requested_max_tokens,
        )


@dataclass
class Trajectory:
    """One training sample: a token sequence and which of its tokens the policy sampled.

    All tensors are 1-D of length T and aligned with `input_ids`: position t describes
    token `input_ids[t]`. `loss_mask[t]` is True exactly where the policy sampled the
    token; `behavior_logprobs[t]` is the engine's logprob of that token (0 elsewhere)
    and `versions[t]` the policy version that sampled it (-1 elsewhere). `truncated`: a
    model call of the sample stopped at its token limit (finish_reason "length");
    `longest_call_tokens`: the most tokens sampled by one of its calls, the length that
    limit bounds (None: all its sampled tokens, as for one call).

    Its place in its episode, for the credit options of multi-turn rollouts
    (`train.credit`): `turn`, the 1-based position of its first model call among the
    rollout's calls; `episode_return`, the rollout's reward (the episode return), which
    every sample of the rollout holds; `step_reward`, the call's own reward r_t (None:
    `reward`).
    """

    input_ids: torch.Tensor  # (T,) int64
    loss_mask: torch.Tensor  # (T,) bool, contiguous
    behavior_logprobs: torch.Tensor  # (T,) float32
    versions: torch.Tensor  # (T,) int64
    reward: float
    group_id: str = ""
    session_id: str = ""
    text: str = ""
    truncated: bool = False
    longest_call_tokens: int | None = None
    turn: int = 1
    episode_return: float | None = None
    step_reward: float | None = None

    def __post_init__(self) -> None:
        t = self.input_ids.shape
        for name in ("loss_mask", "behavior_logprobs", "versions"):
            value = getattr(self, name)
            if value.shape != t:
                raise ValueError(
                    f"Trajectory.{name} has shape {tuple(value.shape)}, input_ids has {tuple(t)}"
                )
        if self.loss_mask.dtype != torch.bool or not self.loss_mask.is_contiguous():
            raise ValueError("Trajectory.loss_mask must be a contiguous bool tensor")
        if not bool(self.loss_mask.any()):
            raise ValueError("Trajectory.loss_mask has no sampled token; nothing to train on")
        if bool(self.loss_mask[0]):
            raise ValueError("Trajectory.loss_mask[0] is True; the first token is never sampled")
        if self.longest_call_tokens is None:
            self.longest_call_tokens = self.num_sampled_tokens
        if self.turn < 1:
            raise ValueError(f"Trajectory.turn={self.turn} must be >= 1 (1-based)")
        if self.episode_return is None:
            self.episode_return = self.reward
        if self.step_reward is None:
            self.step_reward = self.reward

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_sampled_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def oldest_version(self) -> int:
        return int(self.versions[self.loss_mask].min())

    def to_json(self) -> dict:
        return {
            "input_ids": self.input_ids.tolist(),
            "loss_mask": self.loss_mask.int().tolist(),
            "behavior_logprobs": self.behavior_logprobs.tolist(),
            "versions": self.versions.tolist(),
            "reward": self.reward,
            "group_id": self.group_id,
            "session_id": self.session_id,
            "text": self.text,
            "truncated": self.truncated,
            "longest_call_tokens": self.longest_call_tokens,
            "turn": self.turn,
            "episode_return": self.episode_return,
            "step_reward": self.step_reward,
        }

    @classmethod
    def from_json(cls, row: dict) -> Trajectory:
        return cls(
            input_ids=torch.tensor(row["input_ids"], dtype=torch.int64),
            loss_mask=torch.tensor(row["loss_mask"], dtype=torch.bool),
            behavior_logprobs=torch.tensor(row["behavior_logprobs"], dtype=torch.float32),
            versions=torch.tensor(row["versions"], dtype=torch.int64),
            reward=float(row["reward"]),
            group_id=row.get("group_id", ""),
            session_id=row.get("session_id", ""),
            text=row.get("text", ""),
            truncated=bool(row.get("truncated", False)),
            longest_call_tokens=row.get("longest_call_tokens"),
            turn=int(row.get("turn", 1)),
            episode_return=row.get("episode_return"),
            step_reward=row.get("step_reward"),
        )
