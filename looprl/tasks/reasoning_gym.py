"""reasoning-gym's procedural datasets as a task, scored by their own verifiers.

`task.name=reasoning_gym task.dataset=leg_counting task.dataset_kwargs={...}`: the
train split is `create_dataset(dataset, seed=task.seed, size=task.train_size)`, the
held-out split the same with seed + 1 (rows whose question also appears there are
dropped from train). The dataset's `score_answer(answer, entry)` is the reward; the
answer is taken from the completion by `task.answer_format`: reasoning-gym's own
prompts ask for `<answer>...</answer>` ('tags'), which a small chat model rarely
writes, so 'last_line' and 'last_number' read an untagged reply.
"""

from __future__ import annotations

import difflib
import logging
import re
from typing import Any

from looprl.config import ConfigError, TaskConfig

log = logging.getLogger(__name__)

_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(completion: str, answer_format: str) -> str | None:
    """The answer part of `completion` under `answer_format`, or None.

    >>> extract_answer("I count <answer> 12 </answer>.", "tags")
    '12'
    >>> extract_answer("Let me think.\\nThe total is 12\\n", "last_line")
    'The total is 12'
    >>> extract_answer("2 + 10 = 12 legs", "last_number")
    '12'
    """
    if answer_format == "tags":
        found = _TAGS.findall(completion)
        return found[-1].strip() if found else None
    if answer_format == "last_line":
        lines = [line.strip() for line in completion.splitlines() if line.strip()]
        return lines[-1] if lines else None
    numbers = _NUMBER.findall(completion)
    return numbers[-1].replace(",", "") if numbers else None


class ReasoningGymReward:
    """`reward_fn(prompt, completion, **row)` for rows of `make_splits`: the dataset's
    verifier on the extracted answer, the entry found by the row's split and index."""

    def __init__(self, datasets: dict[str, Any], answer_format: str):
        self.datasets, self.answer_format = datasets, answer_format

    def __call__(self, prompt: str, completion: str, *, rg_split: str, rg_index: int, **_) -> float:
        answer = extract_answer(completion, self.answer_format)
        if answer is None:
            return 0.0
        dataset = self.datasets[rg_split]
        return float(dataset.score_answer(answer, dataset[rg_index]))


def make_splits(cfg: TaskConfig) -> tuple[list[dict], list[dict], ReasoningGymReward]:
    """(train rows, held-out rows, reward) of `cfg.dataset`."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise ImportError(
            "task.name=reasoning_gym needs the reasoning-gym package: "
            "pip install 'looprl[envs]' (or reasoning-gym)"
        ) from e
    if cfg.dataset not in DATASETS:
        close = difflib.get_close_matches(cfg.dataset, list(DATASETS), n=3)
        hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
        raise ConfigError(
            f"task.dataset={cfg.dataset!r} is not a reasoning-gym dataset; {hint}it has "
            f"{len(DATASETS)}, e.g. {', '.join(sorted(DATASETS)[:12])}, ..."
        )
    datasets = {}
    for split, seed, size in (
        ("train", cfg.seed, cfg.train_size),
        ("eval", cfg.seed + 1, cfg.eval_size),
    ):
        try:
            datasets[split] = reasoning_gym.create_dataset(
                cfg.dataset, seed=seed, size=size, **cfg.dataset_kwargs
            )
        except (TypeError, ValueError, AssertionError) as e:
            raise ConfigError(
                f"task.dataset_kwargs={cfg.dataset_kwargs!r} do not fit reasoning-gym's "
                f"{cfg.dataset!r}: {type(e).__name__}: {e}"
            ) from None
    rows = {
        split: [
            {
                "question": e["question"],
                "answer": str(e["answer"]),
                "rg_split": split,
                "rg_index": i,
            }  # fmt: skip
            for i, e in enumerate(data)
        ]
        for split, data in datasets.items()
    }
    held_out = {row["question"] for row in rows["eval"]}
    train = [row for row in rows["train"] if row["question"] not in held_out]
    if len(train) < len(rows["train"]):
        log.info(
            "Dropped %d of %d train problems of %s that are also in the held-out split",
            len(rows["train"]) - len(train),
            len(rows["train"]),
            cfg.dataset,
        )
    if not train:
        raise ConfigError(
            f"task.dataset={cfg.dataset!r}: every train problem is also held out; raise "
            "task.train_size or widen task.dataset_kwargs"
        )
    return train, rows["eval"], ReasoningGymReward(datasets, cfg.answer_format)
