"""rollout: groups, batches, concurrency and how rewards reach each call."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from looprl.config.base import Section


class RolloutConfig(Section):
    group_size: int = Field(8, ge=1, description="Rollouts per dataset row (GRPO group).")
    batch_size: int = Field(8, ge=1, description="Dataset rows (groups) per training step.")
    max_concurrent_rollouts: int = Field(64, ge=1, description="Most rollouts running at once.")
    max_head_offpolicyness: int = Field(
        0,
        ge=0,
        description="How many policy versions a trajectory may lag the trainer; "
        "0 is synchronous RL.",
    )
    timeout_s: float = Field(
        300.0, gt=0, description="A rollout running longer is cancelled and counted as timed out."
    )
    max_failure_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Stop the run (exit code 1, with the workflow's own traceback) when more "
        "than this share of the last failure_window rollouts failed: the workflow raised, "
        "returned an unusable reward, made no model call or ran past timeout_s. 1 never "
        "stops: failed rollouts are counted and others drawn instead.",
    )
    failure_window: int | None = Field(
        None,
        ge=2,
        description="Rollouts the failure budget looks back over; None: one step's "
        "(batch_size x group_size), at least two groups. At least two groups when set.",
    )
    seeded: bool = Field(
        False,
        description="Give every rollout its own sampling seed, from run.seed and its "
        "admission order, so a resumed synchronous run samples what an uninterrupted one "
        "would (the engine then samples row by row).",
    )
    dynamic_filtering: bool = Field(
        False,
        description="DAPO dynamic sampling: leave out groups whose rewards are all equal "
        "(zero advantage) and keep sampling until the batch is full.",
    )
    blocked_warning_s: float = Field(
        60.0,
        gt=0,
        description="Warn once when admission has kept a waiting batch from filling this long.",
    )
    trajectory_mode: Literal["concat", "per_call"] = Field(
        "concat",
        description="Multi-call sessions: one concatenated sample when the prompts "
        "extend each other (else per call), or always one sample per call.",
    )
    reward_assignment: Literal["broadcast", "last_call"] = Field(
        "broadcast",
        description="A rollout's single reward goes to every call (times reward_discount "
        "per later call) or to the last call only (earlier calls get 0). Per-call rewards "
        "(a dict, or posted with a completion_id) are used as given.",
    )
    reward_discount: float = Field(
        1.0,
        gt=0,
        le=1,
        description="broadcast: call k of K gets reward * reward_discount ** (K - 1 - k).",
    )

    def failure_window_rollouts(self) -> int:
        """failure_window as set, else one step's rollouts, at least two groups."""
        if self.failure_window is not None:
            return self.failure_window
        return max(self.batch_size, 2) * self.group_size

    @model_validator(mode="after")
    def _groups_can_start(self) -> RolloutConfig:
        if self.group_size > self.max_concurrent_rollouts:
            raise ValueError(
                f"group_size={self.group_size} > max_concurrent_rollouts="
                f"{self.max_concurrent_rollouts}: a group starts all its rollouts at once, "
                "so none could ever start; raise max_concurrent_rollouts"
            )
        if self.failure_window is not None and self.failure_window < 2 * self.group_size:
            raise ValueError(
                f"failure_window={self.failure_window} is less than two groups "
                f"(2 x group_size={self.group_size}): one unlucky group would stop the run; "
                f"set it to at least {2 * self.group_size}, or leave it unset"
            )
        if self.dynamic_filtering and self.group_size < 2:
            raise ValueError(
                "dynamic_filtering=true needs group_size >= 2: a group of one always has "
                "all-equal rewards, so every group would be left out"
            )
        return self
