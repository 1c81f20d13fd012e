"""`Trainer.train_step` on the event loop's thread vs in a worker thread.

Claim measured: running `train_step` in a worker thread, as the training loop does
(`looprl/loop.py`) so that the event loop stays live, costs little by itself; Python
running on the loop meanwhile slows it through the GIL. The same step on
SmolLM2-135M-Instruct (bf16 autocast, 32 sequences of 38 prompt + 48 completion
tokens, `bench/trl_train_throughput.py`'s batch), alternating (1) inline, (2)
`asyncio.to_thread`, (3) `asyncio.to_thread` while the loop thread runs Python in 2 ms
slices a third of the time (workflows and the gateway during asynchronous RL). Median
of `--rounds` after a warm-up step.

    .venv/bin/python bench/train_step_thread.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
from trl_train_throughput import looprl_trainer_and_batch, make_batch

from looprl.config import TrainConfig
from looprl.models import default_model_dir


async def python_load(stop: asyncio.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < 0.002:
            sum(range(200))
        await asyncio.sleep(0.004)


async def main(rounds: int) -> None:
    model_dir = default_model_dir()
    trainer, batch = looprl_trainer_and_batch(
        make_batch(model_dir), model_dir, TrainConfig(lr=1e-6)
    )
    trainer.train_step(batch)  # warm-up
    times: dict[str, list[float]] = {"inline": [], "worker thread": [], "worker + loop busy": []}
    for r in range(rounds):
        start = time.perf_counter()
        trainer.train_step(batch)
        times["inline"].append(time.perf_counter() - start)
        start = time.perf_counter()
        await asyncio.to_thread(trainer.train_step, batch)
        times["worker thread"].append(time.perf_counter() - start)
        stop = asyncio.Event()
        load = asyncio.create_task(python_load(stop))
        start = time.perf_counter()
        await asyncio.to_thread(trainer.train_step, batch)
        times["worker + loop busy"].append(time.perf_counter() - start)
        stop.set()
        await load
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
    base = statistics.median(times["inline"])
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads; median of {rounds}")
    print("| where train_step runs | s per step | vs inline |")
    print("|---|---:|---:|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {median / base:.2f}x |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    asyncio.run(main(parser.parse_args().rounds))
