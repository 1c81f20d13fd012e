"""Rows for task.name=env: one seed per episode of env.name.

Train rows are seeds `task.seed * 2,000,000 + i` (i < task.train_size), held-out rows
`task.seed * 2,000,000 + 1,000,000 + i` (i < task.eval_size): the held-out episodes are
seeds training never plays (with FrozenLake's random_map_size, maps it never saw).
A row is `{"id": "seed-N", "seed": N}`; the episode's reward comes from the env.
"""

from __future__ import annotations

from looprl.config import TaskConfig

HELD_OUT_OFFSET = 1_000_000
SEEDS_PER_TASK_SEED = 2 * HELD_OUT_OFFSET


def make_splits(cfg: TaskConfig) -> tuple[list[dict], list[dict]]:
    """(train, held_out) seed rows for `cfg`."""
    for field in ("train_size", "eval_size"):
        if getattr(cfg, field) > HELD_OUT_OFFSET:
            raise ValueError(
                f"task.{field}={getattr(cfg, field)} is above {HELD_OUT_OFFSET:,} seeds, where "
                "train and held-out seeds would overlap; lower it"
            )
    base = cfg.seed * SEEDS_PER_TASK_SEED
    train = [_row(base + i) for i in range(cfg.train_size)]
    held_out = [_row(base + HELD_OUT_OFFSET + i) for i in range(cfg.eval_size)]
    return train, held_out


def _row(seed: int) -> dict:
    return {"id": f"seed-{seed}", "seed": seed}
