"""Chats for `looprl sft` from a FrozenLake walker that reads the tiles: a warm start for RL.

    python examples/envs/frozen_lake_chats.py OUT.jsonl [--maps 300] \
        [--config examples/envs/frozen_lake_goal.yaml] [--ties random|first]

The walker takes, on each training map of the config's task (seeds from
looprl/tasks/env_seeds.py: never a held-out one), a shortest walk to the goal around the
holes (`walking_distances`). Where two moves are equally short, `--ties random` (the
default) draws one, seeded by the map; `--ties first` takes the first in the env's action
order (left, down, right, up). The observation shows only the neighbouring tiles, so one
prompt stands for several maps: with random ties the fine-tuned policy's greedy move is
the one that is shortest on more of them, with `first` the one a fixed order favours
(98% vs 88% greedy held-out success on FrozenLake 3x3, BENCHMARKS.md). Each turn becomes
one chat: exactly the messages EnvWorkflow sends for that turn under the config's `env`
section (system prompt, the last `history_turns` turns, the observation), then the move
word as the assistant's reply.
A map whose start cannot reach the goal within `env.max_turns` moves is skipped.

Then `looprl sft CONFIG OUT.jsonl ...` and RL from its model: the recipe is at the top of
examples/envs/frozen_lake_goal.yaml.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from looprl.config import load_config
from looprl.envs.gymnasium import FROZEN_LAKE_ACTIONS, GymnasiumEnv, walking_distances
from looprl.tasks.env_seeds import make_splits
from looprl.workflows.env import EnvWorkflow

MOVES = dict(zip(FROZEN_LAKE_ACTIONS, ((0, -1), (1, 0), (0, 1), (-1, 0)), strict=True))


def shortest_moves(env: GymnasiumEnv) -> list[str]:
    """The moves, in the env's action order, that shorten the walk to the goal by one step
    from where the player stands; none where the goal cannot be reached from there."""
    desc = env.env.unwrapped.desc
    distances = walking_distances(desc)
    here = divmod(int(env.state), desc.shape[1])
    if here not in distances:
        return []
    return [
        word
        for word, (dr, dc) in MOVES.items()
        if distances.get((here[0] + dr, here[1] + dc)) == distances[here] - 1
    ]


def walk_chats(
    env: GymnasiumEnv, workflow: EnvWorkflow, seed: int, ties: str = "random"
) -> list[dict] | None:
    """The chats of the walker's episode on map `seed`, one per turn; None when it does
    not reach the goal within env.max_turns. `ties`: first or random (module docstring)."""
    rng = random.Random(seed)
    prompt = env.reset(seed)
    turns: list[tuple[str, str]] = []
    chats = []
    for _ in range(workflow.cfg.max_turns):
        moves = shortest_moves(env)
        if not moves:
            return None
        move = moves[0] if ties == "first" else rng.choice(moves)
        chats.append({"messages": [*workflow.messages(turns, prompt), _reply(move)]})
        turns.append((prompt, move))
        prompt, _, done, info = env.step(move)
        if done:
            return chats if info["success"] else None
    return None


def _reply(move: str) -> dict[str, str]:
    return {"role": "assistant", "content": move}


def write_chats(
    config: str | Path, maps: int, out: str | Path, ties: str = "random"
) -> tuple[int, int]:
    """Write the walker's chats on the config's first `maps` training maps to `out`;
    returns (maps walked to the goal, chats written)."""
    cfg = load_config(config)
    if not (cfg.env.name or "").startswith("gymnasium:FrozenLake"):
        raise ValueError(f"{config}: env.name={cfg.env.name!r}; this walker plays FrozenLake")
    train, _ = make_splits(cfg.task)
    if maps > len(train):
        raise ValueError(f"--maps {maps} is more than {config}'s task.train_size={len(train)}")
    env = GymnasiumEnv(cfg.env.name.split(":", 1)[1], **cfg.env.kwargs)
    # The workflow only renders each turn's messages here (one env worker process idles).
    workflow = EnvWorkflow(**{**cfg.env.model_dump(), "workers": 1})
    walked = written = 0
    try:
        with open(out, "w") as f:
            for row in train[:maps]:
                chats = walk_chats(env, workflow, row["seed"], ties)
                if chats is None:
                    continue
                walked += 1
                for chat in chats:
                    f.write(json.dumps(chat) + "\n")
                    written += 1
    finally:
        workflow.close()
    return walked, written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the JSONL file of chats to write")
    parser.add_argument("--maps", type=int, default=300, help="training maps to walk")
    parser.add_argument(
        "--config",
        default="examples/envs/frozen_lake_goal.yaml",
        help="the looprl config whose env and task sections the chats follow",
    )
    parser.add_argument(
        "--ties",
        choices=("first", "random"),
        default="random",
        help="of equally short moves, the first in the action order or one drawn at random",
    )
    args = parser.parse_args()
    walked, written = write_chats(args.config, args.maps, args.out, args.ties)
    print(
        f"{written} chats from {walked} of {args.maps} training maps "
        f"({args.maps - walked} skipped: the walker found no way to the goal) -> {args.out}"
    )


if __name__ == "__main__":
    main()
