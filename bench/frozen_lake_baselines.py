"""What a FrozenLake held-out success means: the success of policies that ignore the map,
on the maps `examples/envs/frozen_lake.yaml` holds out, and the training episodes that
reached the goal in a run's trajectory files.

    python bench/frozen_lake_baselines.py [RUN_DIR ...]

Prints, on the 50 held-out 3x3 maps (seeds 1,000,000 + i, as task.name=env draws them
for run.seed 0): each fixed walk of two rights and two downs, and moves drawn uniformly
from all four and from right/down for up to 6 turns (2,000 episodes each, seeded). For
each RUN_DIR: per step, the sampled training episodes whose last call earned the goal's
reward (1 plus the distance reward: at least 1).
"""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

from looprl.envs.gymnasium import GymnasiumEnv
from looprl.runs.trajectories import list_steps, read_step
from looprl.tasks.env_seeds import HELD_OUT_OFFSET

MAPS = [HELD_OUT_OFFSET + i for i in range(50)]
MAX_TURNS = 6


def success(env: GymnasiumEnv, seed: int, moves) -> bool:
    """Whether walking `moves` (an iterator of move words) from the map's start reaches the
    goal within MAX_TURNS."""
    env.reset(seed)
    for move in itertools.islice(moves, MAX_TURNS):
        _, _, done, info = env.step(move)
        if done:
            return info["success"]
    return False


def main(run_dirs: list[str]) -> None:
    env = GymnasiumEnv("FrozenLake-v1", random_map_size=3)
    plans = sorted({"".join(p) for p in itertools.permutations("RRDD")})
    words = {"R": "right", "D": "down"}
    for plan in plans:
        rate = sum(success(env, s, (words[c] for c in plan)) for s in MAPS) / len(MAPS)
        print(f"fixed walk {plan}: {rate:.0%}")
    rng = random.Random(0)
    for name, choices in (
        ("all four", ("left", "down", "right", "up")),
        ("right/down", ("right", "down")),
    ):
        episodes = [
            success(env, seed, iter(lambda c=choices: rng.choice(c), None))
            for _ in range(40)
            for seed in MAPS
        ]
        print(f"moves drawn uniformly from {name}: {sum(episodes) / len(episodes):.1%}")
    for run_dir in map(Path, run_dirs):
        counts = []
        for _, path in list_steps(run_dir):
            episodes = {row["session_id"]: row["calls"] for row in read_step(path)}
            goal = sum(calls[-1]["reward"] >= 1.0 for calls in episodes.values())
            counts.append(f"{goal}/{len(episodes)}")
        print(f"{run_dir}: training episodes at the goal per step: {', '.join(counts)}")


if __name__ == "__main__":
    main(sys.argv[1:])
