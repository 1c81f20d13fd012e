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

from common import Row, write_result

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


async def run(offpolicyness: int, pause: str, steps: int, root: Path) -> dict:
    cfg = load_config(
        None,
        [
            f"run.fileroot={root}",
            f"run.trial_name=off{offpolicyness}-{pause}",
            f"rollout.max_head_offpolicyness={offpolicyness}",
            f"engine.pause_while_training={pause}",
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
        "wait_s": sum(r["batch_wait_s"] for r in train_steps) / len(train_steps),
        "sync_s": sum(r["weight_sync_s"] for r in train_steps) / len(train_steps),
        "tokens_trained": sum(r["num_sampled_tokens"] for r in train_steps) / len(train_steps),
        "staleness_max": max(r["staleness_max"] for r in train_steps),
        "reward_mean": sum(r["reward_mean"] for r in train_steps) / len(train_steps),
    }


def modes(offpolicyness: int) -> list[tuple[str, int, str]]:
    """(name, max_head_offpolicyness, engine.pause_while_training) of each measured run."""
    return [
        ("sync", 0, "always"),
        ("async", offpolicyness, "always"),
        ("async, engine not paused", offpolicyness, "never"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--latency-s", type=float, default=2.0)
    parser.add_argument("--offpolicyness", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the results here (bench/common.py)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    add_latency(args.latency_s)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, off, pause in modes(args.offpolicyness):
            print(
                f"running {name} (max_head_offpolicyness={off}, pause {pause}), "
                f"{args.steps} steps ...",
                flush=True,
            )
            results[name] = asyncio.run(run(off, pause, args.steps, Path(tmp)))
    print(
        f"\nSmolLM2-135M, 4 prompts x 4 samples x 16 tokens per step, {args.steps} steps, "
        f"{args.latency_s} s added per generate call"
    )
    print(
        "| mode | max_head_offpolicyness | engine paused while training | train steps/hour | "
        "trajectories/s | train_step s/step | rest of the step s/step | of which waiting "
        "for the batch | of which weight sync | sampled tokens trained/step | max staleness | "
        "mean reward |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, off, pause in modes(args.offpolicyness):
        r = results[name]
        print(
            f"| {name} | {off} | {pause} | {r['steps_per_hour']:.0f} | "
            f"{r['trajectories_per_s']:.2f} | {r['train_s']:.2f} | {r['rest_s']:.2f} | "
            f"{r['wait_s']:.2f} | {r['sync_s']:.2f} | {r['tokens_trained']:.0f} | "
            f"{r['staleness_max']:.0f} | {r['reward_mean']:.3f} |"
        )
    sync = results["sync"]["steps_per_hour"]
    for name, _, _ in modes(args.offpolicyness)[1:]:
        print(f"{name} / sync: {results[name]['steps_per_hour'] / sync:.2f}x train steps per hour")
    if args.json:
        setting = f"{args.latency_s:g} s per generate call, {args.steps} steps"
        rows = [
            Row(
                figure=f"train steps per hour, {name} (max_head_offpolicyness={off}), {setting}",
                looprl=results[name]["steps_per_hour"],
                baseline=sync,
                baseline_name="sync (max_head_offpolicyness=0)",
                unit="steps/h",
                better="higher",
                note=f"mean train reward {results[name]['reward_mean']:.3f} vs sync "
                f"{results['sync']['reward_mean']:.3f}",
            )
            for name, off, _ in modes(args.offpolicyness)[1:]
        ]
        write_result(args.json, "async", rows, results)


if __name__ == "__main__":
    main()
