"""Generated arithmetic problems ("What is 7 * 8?") and their exact-answer reward.

Problems are drawn with a seed; the held-out split is fixed by the seed and never
overlaps the train split. When the space of distinct problems is small (single-digit
`+` and `*` has 200), every problem is enumerated and a quarter at most is held out.
"""

from __future__ import annotations

import logging
import random
import re

from looprl.config import TaskConfig

log = logging.getLogger(__name__)

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_ENUMERATE_LIMIT = 20_000


def last_number(text: str) -> float | None:
    """The last number written in `text` ("1,000" counts as 1000), or None."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    try:
        return float(matches[-1].replace(",", ""))
    except ValueError:
        return None


def arithmetic_reward(prompt: str, completion: str, *, answer: int | str, **_) -> float:
    """1.0 when the last number in the completion equals the answer, else 0.0.

    >>> arithmetic_reward("What is 7 * 8?", "7 * 8 = 56.", answer=56)
    1.0
    >>> arithmetic_reward("What is 7 * 8?", "It is 54, not 56? No: 54", answer=56)
    0.0
    """
    value = last_number(completion)
    return 1.0 if value is not None and value == float(answer) else 0.0


def _problem(a: int, op: str, b: int) -> dict:
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"question": f"What is {a} {op} {b}?", "answer": answer}


def make_splits(cfg: TaskConfig) -> tuple[list[dict], list[dict]]:
    """Return (train, held_out) problem rows for `cfg`, deterministic in `cfg.seed`."""
    rng = random.Random(cfg.seed)
    low, high = 10 ** (cfg.digits - 1) if cfg.digits > 1 else 0, 10**cfg.digits - 1
    operators = sorted(set(cfg.operators))
    space = len(operators) * (high - low + 1) ** 2
    if space <= _ENUMERATE_LIMIT:
        keys = [
            (a, op, b)
            for op in operators
            for a in range(low, high + 1)
            for b in range(low, high + 1)
        ]
        rng.shuffle(keys)
        n_eval = min(cfg.eval_size, space // 4)
        if n_eval < cfg.eval_size:
            log.info(
                "Only %d distinct problems exist for digits=%d operators=%s; holding out "
                "%d of them (task.eval_size=%d)",
                space,
                cfg.digits,
                operators,
                n_eval,
                cfg.eval_size,
            )
        held, pool = keys[:n_eval], keys[n_eval:]
        train_keys = [pool[i % len(pool)] for i in range(cfg.train_size)]
        rng.shuffle(train_keys)
    else:
        held_set: set = set()
        while len(held_set) < cfg.eval_size:
            held_set.add((rng.randint(low, high), rng.choice(operators), rng.randint(low, high)))
        held = sorted(held_set, key=lambda k: (k[1], k[0], k[2]))
        train_keys = []
        while len(train_keys) < cfg.train_size:
            key = (rng.randint(low, high), rng.choice(operators), rng.randint(low, high))
            if key not in held_set:
                train_keys.append(key)
    return [_problem(*k) for k in train_keys], [_problem(*k) for k in held]
