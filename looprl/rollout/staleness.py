"""The staleness policy, whole: which rollouts may start, which finished ones are fresh
enough to train on, and how stale what is trained on was.

Every rule takes `version` from one place: the policy version of the engine that
samples (the controller's `version()`; the trainer's, once its weights reached the
engine). A sample's staleness is `version` minus the oldest version among its sampled
tokens.

- Admission (as in AReaL). A new rollout may start only while

      capacity = min(max_concurrent_rollouts - running,
                     (max_head_offpolicyness + version + 1) * batch_size - (accepted + running))

  is positive, where `accepted` counts rollouts finished and handed to training since
  the start, and `running` those in flight (all in rollouts, i.e. sessions, not groups).
  With `max_head_offpolicyness = 0` no rollout for step v+1 starts before the trainer
  reaches version v+1: synchronous RL.
- Eviction. A finished group whose oldest token is more than `max_head_offpolicyness`
  versions behind when a batch takes it is dropped (`is_fresh`), so nothing trained is
  staler than the bound, even a slow rollout that finished late; its rollouts leave
  `accepted`, making room for new ones.
- The metric. `sample_staleness` of each trained sample at the moment its batch was
  taken (`staleness_mean`, `staleness_max` in the rollout stats).
"""

from __future__ import annotations

from dataclasses import dataclass

from looprl.types import Trajectory


@dataclass
class StalenessManager:
    batch_size: int  # rollouts consumed per training step
    max_concurrent_rollouts: int
    max_head_offpolicyness: int
    running: int = 0
    accepted: int = 0
    rejected: int = 0

    def terms(self, version: int) -> tuple[int, int]:
        """The admission formula's two terms: (concurrency, staleness)."""
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

    def formula(self, version: int) -> str:
        """The admission formula written out with this moment's numbers, ending in the
        capacity: 'min(max_concurrent_rollouts - running, ...) = min(8 - 2, ...) = 6'."""
        concurrency, staleness = self.terms(version)
        return (
            "min(max_concurrent_rollouts - running, (max_head_offpolicyness + version + 1) "
            f"* batch_size - (accepted + running)) = min({self.max_concurrent_rollouts} - "
            f"{self.running}, ({self.max_head_offpolicyness} + {version} + 1) * "
            f"{self.batch_size} - ({self.accepted} + {self.running})) = min({concurrency}, "
            f"{staleness}) = {min(concurrency, staleness)}"
        )

    def blocked_message(
        self, version: int, blocked: str, *, who: str, asked: int, starting: int, rows: int,
        group_size: int,
    ) -> str:  # fmt: skip
        """The warning when admission blocks `who` (`blocked`: for how long, waiting for
        what), who `asked` for groups, while a group of `starting` rollouts waits to start
        (`rows`, `group_size`: rollout.batch_size and group_size): the formula with its
        numbers, the term that limits, and the setting to raise."""
        concurrency, staleness = self.terms(version)
        lines = [
            f"Rollout admission has blocked {blocked}",
            "A group starts when the admission capacity reaches its size; here "
            f"{self.formula(version)} < {starting} (batch_size counts rollouts: "
            f"rollout.batch_size={rows} x group_size={group_size}).",
        ]
        if staleness < starting:
            lines.append(
                f"The staleness term is the limit: {self.accepted} rollouts were accepted "
                f"while the policy version stayed at {version}. Raise "
                f"rollout.max_head_offpolicyness (now {self.max_head_offpolicyness}) to let "
                "rollouts run further ahead of the trainer, or make sure each new version "
                "reaches the engine and the controller (controller.notify_version())."
            )
            if asked > self.ahead_limit() // group_size:
                lines.append(
                    f"{who} asked for {asked} groups, more than (max_head_offpolicyness + 1) "
                    f"x rollout.batch_size = {self.ahead_limit() // group_size} "
                    "can start before the version advances: ask for at most "
                    f"rollout.batch_size={rows}, or raise rollout.batch_size."
                )
        if concurrency < starting:
            lines.append(
                "The concurrency term is the limit: raise rollout.max_concurrent_rollouts "
                f"(now {self.max_concurrent_rollouts})."
            )
        if self.running == 0:
            lines.append("Nothing is running, so this will not unblock by itself.")
        return " ".join(lines)

    def ahead_limit(self) -> int:
        """The most rollouts that can start before the version advances:
        (max_head_offpolicyness + 1) * batch_size."""
        return (self.max_head_offpolicyness + 1) * self.batch_size

    def is_fresh(self, oldest_version: int, version: int) -> bool:
        """Whether a group whose oldest sampled token is from `oldest_version` may still be
        trained on at `version`."""
        return version - oldest_version <= self.max_head_offpolicyness

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

    def state_dict(self, untrained: int) -> dict:
        """The counts a resumed run starts from. `untrained`: accepted rollouts no batch
        has taken yet. They are not saved (the resumed run samples their rows again), so
        they leave `accepted`: counted, each would shrink the resumed run's lead over the
        trainer for good, and after a few resumes an asynchronous run ran synchronously."""
        return {"accepted": self.accepted - untrained, "rejected": self.rejected}

    def load_state_dict(self, state: dict) -> None:
        self.accepted, self.rejected, self.running = state["accepted"], state["rejected"], 0


def sample_staleness(trajectories: list[Trajectory], version: int) -> list[int]:
    """Per trajectory: `version` minus the oldest policy version among its sampled tokens."""
    return [version - t.oldest_version() for t in trajectories]
