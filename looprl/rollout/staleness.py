"""Admission control for rollouts: bounded concurrency and bounded staleness.

Owns one formula (as in AReaL). A new rollout may start only while

    capacity = min(max_concurrent_rollouts - running,
                   (max_head_offpolicyness + version + 1) * batch_size - (accepted + running))

is positive, where `version` is the trainer's policy version, `accepted` counts
rollouts finished and handed to training since the start, and `running` those in
flight (all in rollouts, i.e. sessions, not groups). With `max_head_offpolicyness = 0`
no rollout for step v+1 starts before the trainer reaches version v+1: synchronous RL.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessManager:
    batch_size: int  # rollouts consumed per training step
    max_concurrent_rollouts: int
    max_head_offpolicyness: int
    running: int = 0
    accepted: int = 0
    rejected: int = 0

    def terms(self, version: int) -> tuple[int, int]:
        """The formula's two terms: (concurrency, staleness)."""
        concurrency = self.max_concurrent_rollouts - self.running
        staleness = (self.max_head_offpolicyness + version + 1) * self.batch_size - (
            self.accepted + self.running
        )
        return concurrency, staleness

    def capacity(self, version: int) -> int:
        return min(self.terms(version))

    def explain(self, version: int) -> str:
        """The numbers in the formula, for a log line when admission is blocked."""
        return (
            f"running={self.running}, accepted={self.accepted}, version={version}, "
            f"batch_size={self.batch_size}, max_concurrent_rollouts="
            f"{self.max_concurrent_rollouts}, max_head_offpolicyness="
            f"{self.max_head_offpolicyness}: capacity={self.capacity(version)}"
        )

    def on_start(self) -> None:
        self.running += 1

    def on_accept(self) -> None:
        self.running -= 1
        self.accepted += 1

    def on_reject(self) -> None:
        """A rollout that produced no training data frees its slot for another."""
        self.running -= 1
        self.rejected += 1

    def on_drop_accepted(self) -> None:
        """An accepted rollout left out of training after all (too stale by then)."""
        self.accepted -= 1
        self.rejected += 1

    def state_dict(self) -> dict:
        return {"accepted": self.accepted, "rejected": self.rejected}

    def load_state_dict(self, state: dict) -> None:
        self.accepted, self.rejected, self.running = state["accepted"], state["rejected"], 0
