"""Collapse: a policy that stops exploring, told in plain words with the setting to turn.

Owns `action_stats` (the distribution of a step's replies over their first word: a
multi-turn agent's actions, e.g. FrozenLake's four moves) and `CollapseWatch`, which
reads each training step's record and warns when the sampled tokens' entropy falls
below `diagnostics.collapse_entropy` or one action takes `diagnostics.collapse_action_share`
of the replies, naming the settings that counter it. A warning repeats at most every
`REPEAT_STEPS` steps while the condition lasts.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from typing import Any

from looprl.config import DiagnosticsConfig

log = logging.getLogger(__name__)

TOP_ACTIONS = 6  # actions logged by name; the rest are action_share_other
REPEAT_STEPS = 10
NO_WORD = "none"  # a reply with no word in it
_FIRST_WORD = re.compile(r"[^\W_]+")

COUNTERS = (
    "train.entropy_coef (an entropy bonus, e.g. 0.01; with train.entropy_floor it acts "
    "only below a floor), train.eps_clip_high (clip-higher, e.g. 0.28, lets unlikely "
    "replies grow), train.kl_coef (a KL to the starting policy, e.g. 0.05) or a higher "
    "sampling.temperature"
)


def first_word(reply: str) -> str:
    """The action a reply names: its first word, lowercased ("Right, then down" ->
    "right"); `NO_WORD` when it has none."""
    found = _FIRST_WORD.search(reply.lower())
    return found.group(0) if found else NO_WORD


def action_stats(replies: list[str]) -> dict[str, float]:
    """The replies' distribution over their first word: `action_share_<word>` for the
    TOP_ACTIONS most common words (ties: first seen) and `action_share_other` for the
    rest (each a share, summing to 1), `action_top_share` and `action_entropy` (nats,
    over every word). Empty without replies."""
    if not replies:
        return {}
    counts = Counter(first_word(reply) for reply in replies)
    total = len(replies)
    top = counts.most_common(TOP_ACTIONS)
    stats = {f"action_share_{word}": n / total for word, n in top}
    stats["action_share_other"] = (total - sum(n for _, n in top)) / total
    stats["action_top_share"] = top[0][1] / total
    stats["action_entropy"] = -sum(n / total * math.log(n / total) for n in counts.values())
    return stats


class CollapseWatch:
    """Reads each training step's record (`check`) and warns on collapse."""

    def __init__(self, cfg: DiagnosticsConfig):
        self.cfg = cfg
        self.last_warned: dict[str, int] = {}

    def check(self, step: int, record: dict[str, Any]) -> list[str]:
        """The warnings for this step's record (also logged)."""
        found = []
        entropy = record.get("entropy")
        if (
            self.cfg.collapse_entropy > 0
            and entropy is not None
            and entropy < self.cfg.collapse_entropy
        ):
            found.append(
                (
                    "entropy",
                    f"Step {step}: the sampled tokens' entropy is {entropy:.3f} nats per token, "
                    f"below diagnostics.collapse_entropy={self.cfg.collapse_entropy:g}: the "
                    "policy is collapsing onto one reply and will stop exploring. Counter it "
                    f"with {COUNTERS}.",
                )
            )
        top = record.get("action_top_share")
        if top is not None and top >= self.cfg.collapse_action_share:
            word = max(
                (k for k in record if k.startswith("action_share_") and k != "action_share_other"),
                key=lambda k: record[k],
            ).removeprefix("action_share_")
            found.append(
                (
                    "action",
                    f"Step {step}: {top:.0%} of the replies begin with {word!r} (at or above "
                    f"diagnostics.collapse_action_share={self.cfg.collapse_action_share:g}): "
                    "one action has taken over the policy. Counter it with "
                    f"{COUNTERS}.",
                )
            )
        messages = []
        for kind, message in found:
            last = self.last_warned.get(kind)
            if last is None or step - last >= REPEAT_STEPS:
                self.last_warned[kind] = step
                log.warning("%s", message)
                messages.append(message)
        return messages
