"""The four `train.credit` options compared on FrozenLake itself, with a policy small enough
that only the credit differs: which option teaches a multi-turn policy fastest from the
goal reward alone, and how often a group carries no signal.

    python bench/credit.py [--seeds 5] [--steps 40] [--distance-reward 0.2] [--discount 0.5]

The env is looprl's (`gymnasium:FrozenLake-v1`, 3x3 random maps, not slippery, up to 6
moves; training maps are seeds 0.., held-out maps the 50 seeds training never plays, as
`task.name=env` draws them). The policy is a linear softmax over the four moves on what
the observation text says (the tile each move leads to: ice, hole, edge or goal; whether
it heads toward the goal; a bias per move): 9 weights, which can read the tiles, as the
language model must. Each step: 4 maps x 8 episodes (a group per map), the calls'
returns-to-go (the env workflow's `env.discount`), the step rewards and the episode
returns go through `looprl.training.advantages.credit_advantages` with GRPO, exactly as
`build_batch` sends them; the update is the policy gradient of the advantages (one Adam
step, lr 0.02). Printed per option, mean over seeds: held-out success of the policy as it samples
(what training improves; a linear policy's greedy walk jumps to ~75% as soon as one
weight turns positive, so it tells the options apart less) at steps 0, 3, 6, 10, 20 and
the last, greedy held-out success at the end, the share of groups whose episode returns
were all equal (no learning signal), and the sum of the sampled columns against
per_call's (how fast, not only where it ends). The baseline is the first row, per_call
(what looprl did before train.credit), measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from looprl.envs.gymnasium import FROZEN_LAKE_ACTIONS, GymnasiumEnv
from looprl.tasks.env_seeds import HELD_OUT_OFFSET
from looprl.training.advantages import Episodes, credit_advantages
from looprl.training.batch import degenerate_share
from looprl.workflows.env import returns_to_go

MOVES = ((0, -1), (1, 0), (0, 1), (-1, 0))  # left, down, right, up (the env's order)
TILES = {b"S": 0, b"F": 0, b"H": 1, b"G": 3}  # ice 0, hole 1, edge 2, goal 3
MAPS, GROUP, MAX_TURNS, HELD_OUT = 4, 8, 6, 50
CREDITS = ("per_call", "per_turn", "episode", "gae")
EVAL_STEPS = (3, 6, 10, 20)  # and the last


def features(env: GymnasiumEnv) -> torch.Tensor:
    """(4, 9): per move, one-hot of the tile it leads to (4), heads toward the goal (1),
    and a one-hot of the move itself (4), what the observation text tells the model."""
    desc = env.env.unwrapped.desc
    rows, cols = desc.shape
    row, col = divmod(int(env.state), cols)
    goal_row, goal_col = (int(i[0]) for i in np.nonzero(desc == b"G"))
    out = torch.zeros(4, 9)
    for a, (dr, dc) in enumerate(MOVES):
        r, c = row + dr, col + dc
        tile = TILES[desc[r, c]] if 0 <= r < rows and 0 <= c < cols else 2
        out[a, tile] = 1
        out[a, 4] = float(
            abs(goal_row - r) + abs(goal_col - c) < abs(goal_row - row) + abs(goal_col - col)
        )
        out[a, 5 + a] = 1
    return out


def play(env, weights, seed, greedy, gen):
    """One episode: (features per turn, action per turn, step rewards, success)."""
    env.reset(seed)
    feats, actions, rewards, success = [], [], [], False
    for _ in range(MAX_TURNS):
        phi = features(env)
        logits = phi @ weights
        if greedy:
            a = int(logits.argmax())
        else:
            a = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        _, reward, done, info = env.step(FROZEN_LAKE_ACTIONS[a])
        feats.append(phi)
        actions.append(a)
        rewards.append(reward)
        success = info["success"]
        if done:
            break
    return feats, actions, rewards, success


def held_out(env, weights, greedy, gen) -> float:
    seeds = [HELD_OUT_OFFSET + i for i in range(HELD_OUT)]
    with torch.no_grad():
        return sum(play(env, weights, s, greedy, gen)[3] for s in seeds) / HELD_OUT


def run(credit: str, seed: int, args) -> dict[str, float]:
    env = GymnasiumEnv("FrozenLake-v1", random_map_size=3, distance_reward=args.distance_reward)
    gen = torch.Generator().manual_seed(seed)
    weights = torch.zeros(9, requires_grad=True)
    optimizer = torch.optim.Adam([weights], lr=args.lr)
    curve, shares = {0: held_out(env, weights, False, gen)}, []
    next_map = seed * 100_000
    for step in range(1, args.steps + 1):
        feats, acts, to_go, steps, returns, group, episode, turn = ([] for _ in range(8))
        for m in range(MAPS):
            for e in range(GROUP):
                with torch.no_grad():
                    phi, a, r, _ = play(env, weights, next_map + m, False, gen)
                feats += phi
                acts += a
                to_go += returns_to_go(r, args.discount)
                steps += r
                returns += [sum(r)] * len(r)
                group += [m] * len(r)
                episode += [m * GROUP + e] * len(r)
                turn += list(range(1, len(r) + 1))
        next_map += MAPS
        episodes = Episodes(
            torch.tensor(episode), torch.tensor(turn), torch.tensor(returns), torch.tensor(steps)
        )
        group_index = torch.tensor(group)
        advantages, _ = credit_advantages(
            credit, "grpo", torch.tensor(to_go), group_index, episodes,
            gamma=args.discount, gae_lambda=args.gae_lambda,
        )  # fmt: skip
        shares.append(degenerate_share(group_index, episodes))
        logits = torch.stack(feats) @ weights  # (N, 4)
        logp = logits.log_softmax(-1)[torch.arange(len(acts)), torch.tensor(acts)]
        loss = -(advantages * logp).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step in (*EVAL_STEPS, args.steps):
            curve[step] = held_out(env, weights, False, gen)
    curve["greedy"] = held_out(env, weights, True, gen)
    curve["degenerate"] = statistics.mean(shares)
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--distance-reward", type=float, default=0.0)
    parser.add_argument("--discount", type=float, default=1.0, help="env.discount and gamma")
    parser.add_argument("--gae-lambda", type=float, default=0.95)
    parser.add_argument("--credits", default=",".join(CREDITS), help="comma-separated")
    args = parser.parse_args()
    start = time.monotonic()
    print(
        f"FrozenLake 3x3, {MAPS} maps x {GROUP} episodes a step, {args.steps} steps, "
        f"{args.seeds} seeds, distance_reward {args.distance_reward:g}, discount "
        f"{args.discount:g}, gae_lambda {args.gae_lambda:g}; held-out success on {HELD_OUT} maps"
    )
    marks = [0, *EVAL_STEPS, args.steps]
    head = " | ".join(f"step {m}" for m in marks)
    print(f"| credit | {head} | greedy, end | groups with equal returns | area vs per_call |")
    print("|---|" + "---:|" * (len(marks) + 3))
    baseline = None
    for credit in args.credits.split(","):
        runs = [run(credit, seed, args) for seed in range(args.seeds)]
        mean = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
        # The area under the sampled curve, against per_call's: how fast, not only where.
        area = sum(mean[m] for m in marks)
        baseline = baseline or area
        ratio = area / baseline if baseline else float("nan")
        sampled = " | ".join(f"{mean[m]:.0%}" for m in marks)
        print(
            f"| {credit} | {sampled} | {mean['greedy']:.0%} | {mean['degenerate']:.0%} | "
            f"{ratio:.2f}x |"
        )
    print(f"({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
