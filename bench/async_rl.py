"""Asynchronous vs synchronous RL with a remote-latency engine: train steps per hour and
trajectories per second, the two measured one after the other in one process.

Claim measured: when generation waits on a remote server, letting rollouts run up to
`max_head_offpolicyness` versions ahead of the trainer hides that wait behind training.

Setup: the real training loop (`looprl.loop.train`) on SmolLM2-135M-Instruct (bf16 engine,
bf16 autocast training), the default arithmetic task, 4 prompts x 4 samples per step,
16 new tokens. Every generate call to the local engine first waits `--latency-s`
(default 2 s): the time a remote inference server would take to answer under load. The
local engine then generates for real, so tokens, logprobs and versions are real. Sync
= `rollout.max_head_offpolicyness=0`, async = 2 (`--offpolicyness`); same seed, same
steps. Times are the sum of the steps' `step_time_s` (rollout wait + train step +
weight update), evaluations excluded; the table splits a step into `train_step` and
the rest (waiting for the batch, weight update to the engine).

    .venv/bin/python bench/async_rl.py [--steps 8] [--latency-s 2.0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
from pathlib import Path

from looprl.config import load_config
from looprl.engines.local.engine import LocalEngine
from looprl.loop import train


def add_latency(seconds: float) -> None:
    """Every LocalEngine.generate waits `seconds` before generating (a remote server)."""
    generate = LocalEngine.generate

    async def remote_generate(self, prompt_ids, sampling, *, session=None):
        await asyncio.sleep(seconds)
        return await generate(self, prompt_ids, sampling, session=session)

    LocalEngine.generate = remote_generate


async def run(offpolicyness: int, steps: int, root: Path) -> dict:
    cfg = load_config(
        None,
        [
            f"run.fileroot={root}",
            f"run.trial_name=off{offpolicyness}",
            f"rollout.max_head_offpolicyness={offpolicyness}",
            "rollout.batch_size=4",
            "rollout.group_size=4",
            "sampling.max_new_tokens=16",
            f"train.total_steps={steps}",
            "eval.every_steps=0",
            "eval.size=1",
            "eval.max_new_tokens=4",
        ],
    )
    await train(cfg, show_progress=False)
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").open()]
    train_steps = [r for r in records if r["kind"] == "train"]
    seconds = sum(r["step_time_s"] for r in train_steps)
    trajectories = sum(r["trajectories"] for r in train_steps)
    return {
        "steps": len(train_steps),
        "seconds": seconds,
        "steps_per_hour": 3600 * len(train_steps) / seconds,
        "trajectories_per_s": trajectories / seconds,
        "train_s": sum(r["train_time_s"] for r in train_steps) / len(train_steps),
        "rest_s": sum(r["step_time_s"] - r["train_time_s"] for r in train_steps) / len(train_steps),
        "staleness_max": max(r["staleness_max"] for r in train_steps),
        "reward_mean": sum(r["reward_mean"] for r in train_steps) / len(train_steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--latency-s", type=float, default=2.0)
    parser.add_argument("--offpolicyness", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    add_latency(args.latency_s)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, off in (("sync", 0), ("async", args.offpolicyness)):
            print(f"running {name} (max_head_offpolicyness={off}), {args.steps} steps ...")
            results[name] = asyncio.run(run(off, args.steps, Path(tmp)))
    print(
        f"\nSmolLM2-135M, 4 prompts x 4 samples x 16 tokens per step, {args.steps} steps, "
        f"{args.latency_s} s added per generate call"
    )
    print(
        "| mode | max_head_offpolicyness | train steps/hour | trajectories/s | "
        "train_step s/step | rest of the step s/step | max staleness | mean reward |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, off in (("sync", 0), ("async", args.offpolicyness)):
        r = results[name]
        print(
            f"| {name} | {off} | {r['steps_per_hour']:.0f} | {r['trajectories_per_s']:.2f} | "
            f"{r['train_s']:.2f} | {r['rest_s']:.2f} | {r['staleness_max']:.0f} | "
            f"{r['reward_mean']:.3f} |"
        )
    ratio = results["async"]["steps_per_hour"] / results["sync"]["steps_per_hour"]
    print(f"async / sync: {ratio:.2f}x train steps per hour")


if __name__ == "__main__":
    main()
