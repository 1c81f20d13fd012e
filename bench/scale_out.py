"""The default job under the Ray scheduler vs the local one, measured one after the
other in one process: time per step split into rollout, train step and weight sync.

Claim measured: what scale-out costs on one machine. On a 2-core CPU nothing runs in
parallel that did not before (two replicas share the same two cores, two gloo ranks
split one batch between them), so this is the overhead of actors, the object store,
FSDP2's collectives and the engine pool, not a speed-up; on GPUs each replica and rank
gets its own device.

Setup: `looprl.loop.train` on SmolLM2-135M-Instruct (bf16 engine, bf16 autocast
training), the default arithmetic task, 4 prompts x 8 samples per step, 32 new tokens,
`--steps` steps (default 3), evaluations on 8 rows; the same seed each time.
Configurations: `local` (baseline), `ray 1+1` (one replica, one rank), `ray 2+2` (two
replicas, two gloo ranks), `ray 2+2 broadcast` (weights by gloo broadcast in 32 MiB
buckets rather than through the object store). Reported: medians over steps of
`step_time_s`, `train_time_s` (the update itself) and `weight_sync_s`; rollout = step -
train - sync; the ratio is the median step time over local's. Each configuration runs
in a fresh process, so none inherits another's memory.

    .venv/bin/python bench/scale_out.py [--steps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from looprl.config import load_config
from looprl.loop import train

CONFIGS = {
    "local": [],
    "ray 1+1": ["scheduler.type=ray"],
    "ray 2+2": ["scheduler.type=ray", "scheduler.engine_replicas=2", "scheduler.trainer_ranks=2"],
    "ray 2+2 broadcast": [
        "scheduler.type=ray",
        "scheduler.engine_replicas=2",
        "scheduler.trainer_ranks=2",
        "scheduler.weight_sync=broadcast",
    ],
}


async def run(name: str, overrides: list[str], steps: int, root: Path) -> dict[str, float]:
    cfg = load_config(
        None,
        [
            f"run.fileroot={root}",
            f"run.trial_name={name.replace(' ', '_').replace('+', 'x')}",
            "recover.mode=off",
            f"train.total_steps={steps}",
            "rollout.batch_size=4",
            "rollout.group_size=8",
            "sampling.max_new_tokens=32",
            "eval.every_steps=0",
            "eval.size=8",
            "eval.max_new_tokens=32",
            *overrides,
        ],
    )
    await train(cfg, show_progress=False)
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").open()]
    steps_ = [r for r in records if r["kind"] == "train"]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in steps_)

    step, trained, sync = median("step_time_s"), median("train_time_s"), median("weight_sync_s")
    return {"step": step, "rollout": step - trained - sync, "train": trained, "sync": sync}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one configuration, in a child
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.child:
        with tempfile.TemporaryDirectory() as root:
            result = asyncio.run(run(args.child, CONFIGS[args.child], args.steps, Path(root)))
        print("RESULT " + json.dumps(result), flush=True)
        return
    results = {}
    for name in CONFIGS:  # each in a fresh process: memory and threads of one run only
        cmd = [sys.executable, __file__, "--steps", str(args.steps), "--child", name]
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            print(f"{name} failed (exit {out.returncode}):\n{out.stderr[-3000:]}", flush=True)
            continue
        results[name] = json.loads(lines[-1][len("RESULT ") :])
        print(name, {k: round(v, 2) for k, v in results[name].items()}, flush=True)
    base = results["local"]["step"]
    print()
    print("| configuration | step (s) | rollout (s) | train step (s) | sync (s) | vs local |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['step']:.1f} | {r['rollout']:.1f} | {r['train']:.1f} | "
            f"{r['sync']:.2f} | {r['step'] / base:.2f}x |"
        )


if __name__ == "__main__":
    main()
