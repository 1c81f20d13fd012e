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
import time

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from looprl import startup
from looprl.config import Config
from looprl.engines.local.engine import LocalEngine
from looprl.memory import peak_allocated
from looprl.models import resolve_model
from looprl.precision import cpu


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def _timed(device: torch.device, update, repeats: int) -> list[float]:
    await update()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        await update()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


async def main(device_setting: str, kernels: str, repeats: int) -> None:
    cfg = Config.model_validate({"run": {"device": device_setting}, "engine": {"kernels": kernels}})
    files = resolve_model(cfg.model.path)
    device, why = startup.decide_device(device_setting, startup.cuda_devices())
    decided = startup.choose(cfg, files, device, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu().describe()
    print(f"# weight sync on {device} ({where}; {why}); {decided.engine.describe()}")
    policy = files.load("float32").to(device)  # the trainer's float32 master weights
    engine = LocalEngine.for_model(policy, files.tokenizer, cfg.engine, decided.engine)
    params = sum(p.numel() for p in policy.parameters())
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

    peak_allocated(device, reset=True)
    direct = await _timed(device, in_place, repeats)
    copied = await _timed(device, through_host, repeats)
    peak = peak_allocated(device)
    a, b = statistics.median(direct), statistics.median(copied)
    print(f"params {params / 1e6:.1f}M, {repeats} repeats, median")
    print(f"device-to-device cast (looprl): {a * 1000:8.1f} ms")
    print(f"through host + safetensors:     {b * 1000:8.1f} ms")
    print(f"ratio (host copy / looprl):     {b / a:8.2f}x")
    if peak is not None:
        print(f"peak allocated: {peak / 2**30:.2f} GiB")
    await engine.stop()


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
