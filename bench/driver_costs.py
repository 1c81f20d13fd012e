"""Two costs async RL's driver pays every step, each beside what it cost before:

1. **The optimizer step** on the default model's parameters (SmolLM2-135M, float32, 272
   tensors): `torch.optim.AdamW(fused=True)`, as the trainer builds it on cpu, cuda and
   xpu (`looprl/training/trainer.py`, FUSED_ADAMW_DEVICES), vs torch's default on CPU,
   the single-tensor AdamW (a Python loop over the parameters, holding the GIL that the
   rollouts on the driver's event loop need).
2. **A workflow's OpenAI client**: `session_client` (`looprl/workflows/client.py`: one
   TLS context shared by every client) vs a plain `AsyncOpenAI(...)`, which has httpx
   build a TLS context, loading the CA bundle, for each rollout's client.

Each side runs in this process, alternating, after a warm-up; the median is reported
(other load only slows a run).

    .venv/bin/python bench/driver_costs.py [--repeats 7] [--clients 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
from common import machine
from openai import AsyncOpenAI

from looprl.models import default_model_dir, load_model
from looprl.workflows.client import session_client


def optimizer_step_s(params: list[torch.nn.Parameter], *, fused: bool, repeats: int) -> float:
    """Median seconds of one AdamW step over `params` (gradients set, state warmed)."""
    optimizer = torch.optim.AdamW(params, lr=2e-5, fused=fused)
    optimizer.step()  # warm-up: creates the state (exp_avg, exp_avg_sq)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def client_creation_ms(make, count: int) -> float:
    """Mean milliseconds to create and close one client, over `count`."""
    await make().close()  # warm-up: imports, certifi's path
    start = time.perf_counter()
    for _ in range(count):
        await make().close()
    return (time.perf_counter() - start) / count * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="optimizer steps per side")
    parser.add_argument("--clients", type=int, default=200, help="clients per side")
    args = parser.parse_args()

    found = machine()
    print(
        f"CPU {found['label']} ({found['model']}, {found['cores']} cores), torch {found['torch']}"
    )
    model = load_model(default_model_dir())
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    fused_runs, single_runs = [], []
    for _ in range(2):  # alternate, so drifting load hits both sides
        fused_runs.append(optimizer_step_s(params, fused=True, repeats=args.repeats))
        single_runs.append(optimizer_step_s(params, fused=False, repeats=args.repeats))
    fused, single = min(fused_runs), min(single_runs)
    print(
        f"AdamW step, {len(params)} tensors, {sum(p.numel() for p in params) / 1e6:.0f}M "
        f"parameters: fused {fused:.3f} s, single-tensor {single:.3f} s "
        f"(ratio {single / fused:.2f}x)"
    )

    url, key = "http://127.0.0.1:9/v1", "unused"  # nothing is sent: creation only
    shared = asyncio.run(client_creation_ms(lambda: session_client(url, key), args.clients))
    plain = asyncio.run(
        client_creation_ms(lambda: AsyncOpenAI(base_url=url, api_key=key), args.clients)
    )
    print(
        f"OpenAI client creation: session_client {shared:.2f} ms, plain AsyncOpenAI "
        f"{plain:.2f} ms (ratio {plain / shared:.1f}x)"
    )


if __name__ == "__main__":
    main()
