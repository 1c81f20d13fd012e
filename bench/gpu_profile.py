"""Where the local engine's decode step spends its time on a GPU (the probe whose output
is bench/results/gpu/gpu_profile.log, BENCHMARKS.md's "One GPU, measured").

The GPU check (bench/gpu_check.py) measured the engine at 1.27x Hugging Face `generate`
on one H200 (256 prompts x 512 tokens, bf16, portable kernels): ~65 ms a step for a
135M model whose weights and K/V are read in well under a millisecond, so the step is
the host's. This probe says how it splits: the engine end to end (256 x 128), the fused
decode alone (eager), the same decode replayed from one CUDA graph, the sampler alone,
and the profiler's top operators. A model of SmolLM2-135M's shape with random weights
(no download); token ids are random, EOS ignored.

It ran before the portable decode rounded its attention width (fused.WIDTH_STEP): run
now, its engine and `decode_eager_ms` figures include that change. bench/gpu_engine.py
measures the engine with and without CUDA graphs against `generate`.

    python3 bench/gpu_profile.py --device cuda                   # on the GPU machine
    .venv/bin/python bench/gpu_profile.py --device cpu --quick   # a dry run here
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch
from gpu_engine import SMOLLM2_135M  # beside this file
from transformers import LlamaConfig, LlamaForCausalLM

from looprl.engines.local.engine import LocalEngine
from looprl.engines.local.fused import FusedDecoder
from looprl.engines.local.kv_cache import SlotCache
from looprl.engines.local.sampling import sample
from looprl.types import SamplingParams


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats`, synchronized."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, prompt_len, new_tokens = (8, 16, 8) if args.quick else (256, 48, 128)
    width = prompt_len + new_tokens + 384 if not args.quick else 64  # ~a late decode step
    out: dict = {"device": str(device), "rows": b, "width": width}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(device).eval()

    # A. The engine end to end, and the profiler's view of it.
    engine = LocalEngine(
        model, eos_token_ids=[], dtype=str(dtype).removeprefix("torch."), kernels="portable",
        max_batch_size=b, max_tokens_per_batch=b * (prompt_len + new_tokens + 64),
    )  # fmt: skip
    prompts = torch.randint(100, 40000, (b, prompt_len)).tolist()

    async def generate(n: int) -> float:
        sampling = SamplingParams(max_new_tokens=n, temperature=1.0)
        start = time.perf_counter()
        await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
        return time.perf_counter() - start

    async def engine_part() -> None:
        await generate(4)
        seconds = await generate(new_tokens)
        out["engine_s"] = round(seconds, 3)
        out["engine_ms_per_step"] = round(1000 * seconds / new_tokens, 2)
        out["engine_tokens_per_s"] = round(b * new_tokens / seconds)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            steps = 16 if not args.quick else 4
            seconds = await generate(steps)
        out["profiled_ms_per_step"] = round(1000 * seconds / steps, 2)
        events = prof.key_averages()
        device_us = sum(e.self_device_time_total for e in events) if device.type == "cuda" else 0
        out["profiled_device_ms_per_step"] = round(device_us / 1000 / steps, 2)
        print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
        if device.type == "cuda":
            print(events.table(sort_by="self_cuda_time_total", row_limit=15))
        await engine.stop()

    asyncio.run(engine_part())

    # B. The fused decode alone: eager, then replayed from a CUDA graph.
    dec = FusedDecoder(model.to(dtype), kernels="portable")
    cache = SlotCache(dec, b * width)
    cache.reserve(b, width)
    ids = torch.randint(100, 40000, (b,), device=device)
    positions = torch.full((b,), width - 1, device=device)
    slots = torch.arange(b, device=device)
    with torch.inference_mode():
        out["decode_eager_ms"] = round(
            1000 * timed(lambda: dec.decode(cache, ids, positions, slots), device, 20), 2
        )
        out["decode_static_eager_ms"] = round(
            1000 * timed(lambda: dec.decode_static(cache, ids, positions, width), device, 20),
            2,
        )
        logits = dec.decode(cache, ids, positions, slots)
        params = [SamplingParams(temperature=1.0) for _ in range(b)]
        generator = torch.Generator().manual_seed(0)
        out["sample_ms"] = round(
            1000 * timed(lambda: sample(logits, params, generator, [None] * b), device, 20), 2
        )
        out["tolist_ms"] = round(1000 * timed(lambda: ids.tolist(), device, 20), 3)
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(3):
                    dec.decode_static(cache, ids, positions, width)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graphed = dec.decode_static(cache, ids, positions, width)
            out["decode_graph_ms"] = round(1000 * timed(graph.replay, device, 50), 3)
            eager = dec.decode_static(cache, ids, positions, width)
            graph.replay()
            out["graph_matches_eager"] = bool(torch.allclose(graphed, eager, atol=1e-2))
            for rows in (1, 32):  # does the step's cost scale with rows or stay per launch?
                out[f"decode_eager_ms_b{rows}"] = round(
                    1000
                    * timed(
                        lambda r=rows: dec.decode(cache, ids[:r], positions[:r], slots[:r]),
                        device,
                        20,
                    ),
                    2,
                )
    print("GPU_PROFILE " + json.dumps(out))


if __name__ == "__main__":
    main()
