"""Chats for `looprl sft` from a run's successful rollouts: the sampled-policy warm start.

    python examples/envs/successful_chats.py RUN_DIR OUT.jsonl [--min-reward 1.0]

Reads the run's trajectory files (looprl/runs/trajectories.py; written every
`metrics.trajectories_every` steps) and writes, for each rollout whose last call earned
at least `--min-reward`, each of its calls as one chat: the messages the call sent, then
its reply as the assistant's message. The last call's reward is the rollout's own reward
for a workflow returning one number (reward_assignment broadcast or last_call), and for
an env episode (EnvWorkflow) the last step's reward, its return-to-go: with FrozenLake's
goal reward (1, plus any distance reward) at least 1 means the episode reached the goal.
A rollout trained as several samples appears in several rows of a step with the same
calls: each rollout (session) is written once.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from looprl.runs.trajectories import list_steps, read_step


def successful_chats(run_dir: str | Path, min_reward: float) -> tuple[list[dict], int]:
    """(one chat per call of the rollouts whose last call earned >= `min_reward`, the
    number of rollouts read), over every trajectory file of `run_dir`."""
    steps = list_steps(Path(run_dir))
    if not steps:
        raise FileNotFoundError(
            f"{run_dir} holds no trajectory files; train with metrics.trajectories_every=1"
        )
    sessions: dict[str, list[dict]] = {}
    for _, path in steps:
        for row in read_step(path):
            sessions.setdefault(row["session_id"], row["calls"])
    chats = []
    for calls in sessions.values():
        rewarded = [call for call in calls if call["reward"] is not None]
        if not rewarded or rewarded[-1]["reward"] < min_reward:
            continue
        for call in rewarded:
            reply = {"role": "assistant", "content": call["reply"]}
            chats.append({"messages": [*call["messages"], reply]})
    return chats, len(sessions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a looprl run dir (holding trajectories/)")
    parser.add_argument("out", help="the JSONL file of chats to write")
    parser.add_argument(
        "--min-reward",
        type=float,
        default=1.0,
        help="the least reward of a rollout's last call for its calls to be kept",
    )
    args = parser.parse_args()
    chats, rollouts = successful_chats(args.run_dir, args.min_reward)
    with open(args.out, "w") as f:
        for chat in chats:
            f.write(json.dumps(chat) + "\n")
    print(f"{len(chats)} chats from the successful of {rollouts} rollouts -> {args.out}")


if __name__ == "__main__":
    main()
