"""Learning: a run that cannot learn, or is unlearning, told early in plain words.

Owns `LearningWatch`, which reads a run's metrics records (train and eval, as
looprl/runs/metrics.py logs them) and warns, naming what to change, when

- most groups got equal rewards: their advantages are 0, the step learns nothing
  (`degenerate_group_share` >= DEGENERATE_SHARE while the sampled success is at most
  DEGENERATE_MAX_SUCCESS: groups equal because they all fail, not because they all
  succeed, as at the end of a run that learned its task);
- the model calls at one position of the rollouts stopped at their token limit
  (`truncated_turn_share`, from rollout/truncation.py): nearly all of them
  (TRUNCATED_SHARE), or most of them (TRUNCATED_SHARE_FAILING) while the sampled success
  is at most FAILING_SUCCESS; naming the call and the limit: the agent's max_tokens or
  sampling.max_new_tokens. (The default job starts with ~70% of its replies cut at 48
  tokens and learns: the answer comes first, and the replies shorten.)
- the sampled success on the training rollouts (their `accuracy`, the mean over the
  last SAMPLED_WINDOW steps) is below SAMPLED_RATIO x the held-out success of the latest
  evaluation (greedy unless eval.temperature says otherwise) and SAMPLED_GAP under it;
- held-out success falls HELD_OUT_DROP below its best;
- the sampled tokens' entropy (mean of the last ENTROPY_WINDOW steps) falls below
  ENTROPY_FALL x its value at the best evaluation's step while held-out success is
  ENTROPY_HELD_OUT_SLIP below its best: the policy narrows onto replies that do worse.

The thresholds keep the default job quiet (`make demo`: SmolLM2-135M on arithmetic,
held-out 44-48% -> ~90%, sampled success 0.17-0.33 at step 1 -> 0.9, groups equal only
once most of them succeed) while the runs of issue 50 warn (see docs/diagnosing.md). A
warning repeats at most every REPEAT_STEPS steps while its condition lasts. The policy's
collapse (entropy near 0, one action) is collapse.py's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

REPEAT_STEPS = 4
DEGENERATE_SHARE = 0.75
DEGENERATE_MAX_SUCCESS = 0.5
TRUNCATED_SHARE = 0.9
TRUNCATED_SHARE_FAILING = 0.5
FAILING_SUCCESS = 0.05
SAMPLED_WINDOW = 3
SAMPLED_RATIO = 0.25
SAMPLED_GAP = 0.05
HELD_OUT_DROP = 0.15
ENTROPY_WINDOW = 2
ENTROPY_FALL = 0.5
ENTROPY_HELD_OUT_SLIP = 0.1
_TOLERANCE = 1e-9  # 0.6 - 0.5 is 0.0999...: a fall of exactly a threshold counts

ORDINALS = {1: "1st", 2: "2nd", 3: "3rd"}


@dataclass
class _Point:
    step: int
    accuracy: float | None
    entropy: float | None = None


@dataclass
class LearningWatch:
    """Reads the records of a run's metrics (`check`) and warns when it cannot learn or
    is unlearning. Each warning is logged (the `looprl` logger: terminal and train.log)
    and returned as {"step", "name", "message"} for the metrics to keep."""

    seen: int = 0  # records read so far
    last_warned: dict[str, int] = field(default_factory=dict)
    train: list[_Point] = field(default_factory=list)
    evals: list[_Point] = field(default_factory=list)

    @classmethod
    def after(cls, records: list[dict[str, Any]]) -> LearningWatch:
        """A watch that has read `records` (a resumed run's, or the first evaluation)
        without warning: their warnings (kind "warning") set when each may repeat."""
        watch = cls()
        for record in records:
            watch._read(record)
        watch.seen = len(records)
        return watch

    def check(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The warnings the records after those already read give (also logged)."""
        warnings = []
        for record in records[self.seen :]:
            found = self._read(record)
            for name, message in found:
                step = record["step"]
                last = self.last_warned.get(name)
                if last is None or step - last >= REPEAT_STEPS:
                    self.last_warned[name] = step
                    log.warning("%s", message)
                    warnings.append({"step": step, "name": name, "message": message})
        self.seen = len(records)
        return warnings

    def _read(self, record: dict[str, Any]) -> list[tuple[str, str]]:
        kind, step = record.get("kind"), record["step"]
        if kind == "warning":
            self.last_warned[record["name"]] = step
            return []
        if kind == "train":
            self.train.append(_Point(step, _number(record, "accuracy"), _number(record, "entropy")))
            found = [*self._equal_groups(step, record), *self._truncated(step, record)]
        elif kind == "eval" and _number(record, "accuracy") is not None:
            self.evals.append(_Point(step, record["accuracy"]))
            found = []
        else:  # an eval without accuracy (sft's held-out loss), or a kind of the future
            return []
        return [*found, *self._sampled_below_held_out(step), *self._unlearning(step)]

    def _equal_groups(self, step: int, record: dict[str, Any]) -> list[tuple[str, str]]:
        share = _number(record, "degenerate_group_share")
        success = _number(record, "accuracy")
        if share is None or share < DEGENERATE_SHARE - _TOLERANCE:
            return []
        if success is not None and success > DEGENERATE_MAX_SUCCESS:
            return []  # the groups are equal because they succeed: the task is learned
        told = "" if success is None else f" (sampled success {success:.1%})"
        return [
            (
                "equal_rewards",
                f"Step {step}: {share:.0%} of the groups got the same reward for every "
                f"sample{told}: their advantages are 0 and this step learns nothing from "
                "them. Make the samples of a prompt differ: raise sampling.temperature "
                "(e.g. to 1.2) or rollout.group_size (more samples per prompt), give "
                "partial credit in the reward or easier prompts, fix the agent's prompt so "
                "that some replies succeed, and raise max_tokens if the replies are cut "
                "(truncated_call_share).",
            )
        ]

    def _truncated(self, step: int, record: dict[str, Any]) -> list[tuple[str, str]]:
        share = _number(record, "truncated_turn_share")
        success = _number(record, "accuracy")
        failing = success is not None and success <= FAILING_SUCCESS
        threshold = TRUNCATED_SHARE_FAILING if failing else TRUNCATED_SHARE
        if share is None or share < threshold - _TOLERANCE:
            return []
        turn, calls = int(record["truncated_turn"]), int(record["truncated_turn_calls"])
        limit = record.get("truncated_turn_max_tokens")
        requested = record.get("truncated_turn_requested_max_tokens")
        total = _number(record, "truncated_call_share") or 0.0
        which = (
            "the model calls"
            if record.get("truncated_call_share") == share and turn == 1
            else f"the rollouts' {ORDINALS.get(turn, f'{turn}th')} model calls"
        )
        if requested is None:
            where = f"sampling.max_new_tokens={limit}, as the agent passed no max_tokens"
            change = (
                f"raise sampling.max_new_tokens (now {limit}) or ask for shorter replies "
                "in the agent's prompt"
            )
        elif requested == limit:
            where = f"max_tokens={limit}, which the agent's request passed"
            change = (
                f"raise the max_tokens the agent passes for that call (now {limit}), or "
                "leave it out so that sampling.max_new_tokens applies, or ask for shorter "
                "replies in the agent's prompt"
            )
        else:
            where = (
                f"{limit} tokens, though the agent asked for max_tokens={requested} (the "
                "model's context or the session cut it)"
            )
            change = "shorten the prompt or ask for shorter replies in the agent's prompt"
        return [
            (
                "truncated",
                f"Step {step}: {share:.0%} of {which} ({round(share * calls)} of {calls}) "
                f"stopped at their token limit, {where} ({total:.0%} of all the step's calls "
                "were cut). A cut "
                f"reply seldom earns its reward, so there is little to learn: {change}.",
            )
        ]

    def _sampled_below_held_out(self, step: int) -> list[tuple[str, str]]:
        if not self.evals:
            return []
        held_out = self.evals[-1]
        recent = [p for p in self.train[-SAMPLED_WINDOW:] if p.accuracy is not None]
        if not recent or held_out.accuracy is None:
            return []
        sampled = sum(p.accuracy for p in recent) / len(recent)
        if sampled >= SAMPLED_RATIO * held_out.accuracy or held_out.accuracy - sampled < (
            SAMPLED_GAP - _TOLERANCE
        ):
            return []
        steps = f"step {recent[0].step}" if len(recent) == 1 else f"steps {recent[0].step}-"
        steps += "" if len(recent) == 1 else str(recent[-1].step)
        return [
            (
                "sampled_below_held_out",
                f"Step {step}: train success (sampled) is {sampled:.1%} ({steps}), far "
                f"below held-out success (greedy) of {held_out.accuracy:.1%} at step "
                f"{held_out.step}: the samples the policy learns from are much worse than "
                "its greedy answers. Lower sampling.temperature (e.g. 0.7) or "
                "sampling.top_p (e.g. 0.9), check that the training calls are not cut at "
                "max_tokens (truncated_call_share) and that training and evaluation run "
                "the same prompt and token limit (sampling.max_new_tokens vs "
                "eval.max_new_tokens).",
            )
        ]

    def _unlearning(self, step: int) -> list[tuple[str, str]]:
        if not self.evals:
            return []
        best = max(self.evals, key=lambda p: p.accuracy)  # the first of equals
        latest = self.evals[-1]
        fall = best.accuracy - latest.accuracy
        found = []
        if fall >= HELD_OUT_DROP - _TOLERANCE:
            found.append(
                (
                    "held_out_fell",
                    f"Step {step}: held-out success (greedy) fell to {latest.accuracy:.1%} at "
                    f"step {latest.step}, from its best {best.accuracy:.1%} at step "
                    f"{best.step}: training is making the policy worse. Lower train.lr "
                    "(e.g. halve it), add train.kl_coef (e.g. 0.05), or stop nearer step "
                    f"{best.step} and keep that policy.",
                )
            )
        entropy = [p.entropy for p in self.train[-ENTROPY_WINDOW:] if p.entropy is not None]
        reference = next(
            (p for p in self.train if p.step >= best.step and p.entropy is not None), None
        )
        if (
            fall >= ENTROPY_HELD_OUT_SLIP - _TOLERANCE
            and entropy
            and reference is not None
            and self.train[-1].step > reference.step
        ):
            now = sum(entropy) / len(entropy)
            if now < ENTROPY_FALL * reference.entropy:
                found.append(
                    (
                        "entropy_fell",
                        f"Step {step}: the sampled tokens' entropy fell to {now:.2f} nats "
                        f"per token from {reference.entropy:.2f} at step {reference.step}, "
                        f"the best held-out step ({best.accuracy:.1%}), while held-out "
                        f"success fell to {latest.accuracy:.1%}: the policy is narrowing "
                        "onto replies that do worse. Lower train.lr, add an entropy bonus "
                        "(train.entropy_coef, e.g. 0.01) or train.kl_coef (e.g. 0.05), or "
                        "raise sampling.temperature.",
                    )
                )
        return found


def _number(record: dict[str, Any], key: str) -> float | None:
    """record[key] when it is a number (not None, not NaN)."""
    value = record.get(key)
    if isinstance(value, int | float) and value == value:
        return float(value)
    return None
