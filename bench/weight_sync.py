"""Weight sync, trainer to a collocated local engine, on the default model.

Claim measured: in one process (`scheduler.type=single_process`, engine and trainer on
one device) a weight update is a device-to-device cast of the trainer's parameters into
the engine's weights: no serialization, no folder, no host round trip. The baseline,
measured in the same run on the same device, is what a copy through a server costs at
the least (TRL's colocate mode hands weights to vLLM): the state dict copied to the host,
serialized to safetensors bytes, read back and loaded into the same engine. Both load
the engine the same way afterwards, so the ratio is what the copy costs on top.

Each variant is warmed up, then timed `--repeats` times (median); on a GPU every timing
waits for the device (torch.cuda.synchronize) before it stops.

    .venv/bin/python bench/weight_sync.py                 # run.device=auto: here, the CPU
    .venv/bin/python bench/weight_sync.py --kernels portable  # plain weights, in place
    .venv/bin/python bench/weight_sync.py --device cuda   # on a GPU machine
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from looprl import startup
from looprl.config import load_config
from looprl.engines.local.engine import LocalEngine
from looprl.memory import peak_allocated, reset_peak
from looprl.startup import Setup, describe_device

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.engine import synchronize  # noqa: E402


async def _timed(device: torch.device, update, repeats: int) -> list[float]:
    await update()  # warm-up
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        await update()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


async def measure(setup: Setup, repeats: int) -> dict:
    """Both variants on `setup`'s device, model and engine precision; the figures."""
    device = setup.device
    policy = setup.model.load("float32").to(device)  # the trainer's float32 master weights
    engine = LocalEngine.for_model(
        policy, setup.model.tokenizer, setup.cfg.engine, setup.precision.engine
    )
    version = 0

    async def in_place() -> None:
        nonlocal version
        version += 1
        with torch.no_grad():
            next(policy.parameters()).add_(1e-6)  # the trainer stepped
        await engine.update_weights(policy.state_dict(), version)

    async def through_host() -> None:
        nonlocal version
        version += 1
        host = {k: v.detach().cpu().contiguous() for k, v in policy.state_dict().items()}
        # tied weights share storage: save what safetensors accepts, one copy of each
        received = load_bytes(save_bytes(_untied(host)))
        received = {k: v.to(device) for k, v in received.items()}
        for name, source in _ties(host).items():
            received[name] = received[source]
        await engine.update_weights(received, version)

    reset_peak(device)
    direct = await _timed(device, in_place, repeats)
    copied = await _timed(device, through_host, repeats)
    peak = peak_allocated(device)
    await engine.stop()
    a, b = statistics.median(direct), statistics.median(copied)
    return {
        "device": str(device),
        "engine": setup.precision.engine.describe(),
        "params_m": round(sum(p.numel() for p in policy.parameters()) / 1e6, 1),
        "repeats": repeats,
        "update_weights_ms_median": round(a * 1000, 2),
        "update_weights_ms_all": [round(t * 1000, 2) for t in direct],
        "through_host_ms_median": round(b * 1000, 2),
        "host_copy_over_in_place": round(b / a, 2),
        "peak_gpu_mib": None if peak is None else round(peak / 2**20, 1),
    }


async def main(device_setting: str, kernels: str, repeats: int) -> None:
    overrides = [f"run.device={device_setting}", f"engine.kernels={kernels}"]
    setup = startup.start(load_config(None, [*overrides, f"run.fileroot={tempfile.mkdtemp()}"]))
    print(f"# weight sync on {describe_device(setup.device)}; {setup.precision.engine.describe()}")
    figures = await measure(setup, repeats)
    print(f"params {figures['params_m']}M, {repeats} repeats, median")
    print(f"device-to-device cast (looprl): {figures['update_weights_ms_median']:8.1f} ms")
    print(f"through host + safetensors:     {figures['through_host_ms_median']:8.1f} ms")
    print(f"ratio (host copy / looprl):     {figures['host_copy_over_in_place']:8.2f}x")
    if figures["peak_gpu_mib"] is not None:
        print(f"peak allocated: {figures['peak_gpu_mib']} MiB")


def _ties(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Names whose tensor shares storage with an earlier name, -> that name."""
    seen, ties = {}, {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape)
        if key in seen:
            ties[name] = seen[key]
        else:
            seen[key] = name
    return ties


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    ties = _ties(state)
    return {k: v for k, v in state.items() if k not in ties}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="run.device: auto, cpu, cuda, cuda:N")
    parser.add_argument("--kernels", default="auto", help="engine.kernels: auto, cpu, portable")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(main(args.device, args.kernels, args.repeats))
