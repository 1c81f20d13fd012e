"""A small verifiers environment for the adapter tests, loaded by name:
`verifiers.load_environment("tests.support.vf_envs", turns=N, ...)`.

Its rows ask for a word; the rubric adds `letters` (weight 1: the share of the answer's
letters found in the model's replies) and `replies` (weight 0.25 per reply), so a random
model's score is a number a test works out from the replies it saw. `turns=1` is a
SingleTurnEnv; `turns=N` a MultiTurnEnv whose user answers each reply with "Turn k of N:
try again." until N replies. On the row of `crash_on=WORD` env_response raises a
RuntimeError (which ends the rollout), on that of `fail_on=WORD` a verifiers error (which
verifiers records in the rollout's state); `held_out=False` leaves out the eval_dataset.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

WORDS = ["cat", "dog", "owl", "bee", "fox", "elk"]
WEIGHTS = (1.0, 0.25)  # letters, replies


def _replies(completion) -> list[str]:
    return [m["content"] or "" for m in completion if m["role"] == "assistant"]


def letters(completion, answer) -> float:
    """The share of the answer's letters that appear in the replies."""
    text = "".join(_replies(completion)).lower()
    return sum(letter in text for letter in answer) / len(answer)


def replies(completion) -> float:
    return float(len(_replies(completion)))


class TryAgainEnv(vf.MultiTurnEnv):
    def __init__(self, crash_on: str | None = None, fail_on: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.crash_on, self.fail_on = crash_on, fail_on

    async def env_response(self, messages, state, **kwargs):
        if state["answer"] == self.crash_on:
            raise RuntimeError(f"env_response broke on {self.crash_on!r} on purpose")
        if state["answer"] == self.fail_on:
            raise vf.InfraError(f"the sandbox of {self.fail_on!r} went away on purpose")
        turn = len(state["trajectory"])  # the replies so far
        return [vf.UserMessage(content=f"Turn {turn} of {self.max_turns}: try again.")]


def _rows(words: list[str]) -> Dataset:
    return Dataset.from_list(
        [
            {"question": f"Name an animal: {word}?", "answer": word, "info": {"length": 3}}
            for word in words
        ]
    )


def load_environment(
    turns: int = 1, crash_on: str | None = None, fail_on: str | None = None, held_out: bool = True
) -> vf.Environment:
    options = dict(
        dataset=_rows(WORDS[:4] if held_out else WORDS),
        eval_dataset=_rows(WORDS[4:]) if held_out else None,
        system_prompt="Answer with one word.",
        rubric=vf.Rubric(funcs=[letters, replies], weights=list(WEIGHTS)),
    )
    if turns == 1:
        return vf.SingleTurnEnv(**options)
    return TryAgainEnv(crash_on=crash_on, fail_on=fail_on, max_turns=turns, **options)
