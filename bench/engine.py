"""Local engine decode throughput vs Hugging Face `generate`, on the default model.

Claim measured: LocalEngine serves 32 concurrent requests x 64 new tokens (sampling at
temperature 1, no top-k/top-p) faster than one batched `model.generate` call on the
same 32 prompts, in float32 and in bfloat16. EOS is disabled on both sides so each
produces exactly 32 x 64 tokens; prompt prefill is included in both timings. Each side
is warmed up once, then timed `--repeats` times, alternating; the best run is reported
(other processes on a shared machine only ever make a run slower).

    .venv/bin/python bench/engine.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import torch

from looprl.engines.local import LocalEngine
from looprl.models import load_model, load_tokenizer
from looprl.types import SamplingParams

NUM_PROMPTS = 32
NEW_TOKENS = 64


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


def time_hf_generate(model, prompts: list[list[int]], pad_id: int) -> float:
    """Seconds for one left-padded batched `generate` call over all prompts."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=NEW_TOKENS,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == NEW_TOKENS, f"HF generated {out.shape[1] - width} tokens"
    return elapsed


async def time_engine(engine: LocalEngine, prompts: list[list[int]]) -> float:
    """Seconds for all prompts submitted concurrently to the engine."""
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
    start = time.perf_counter()
    gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
    elapsed = time.perf_counter() - start
    assert all(len(g.output_ids) == NEW_TOKENS for g in gens)
    return elapsed


def matmul_gflops(dtype: torch.dtype) -> float:
    """Decode-shaped (32x576 @ 576x1536) matmul speed: how busy the machine is right now."""
    a, b = torch.randn(32, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(200):
        a @ b
    return 2 * 32 * 576 * 1536 * 200 / (time.perf_counter() - start) / 1e9


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per side and dtype")
    args = parser.parse_args()

    tokenizer = load_tokenizer("default")
    prompts = make_prompts(tokenizer, NUM_PROMPTS)
    tokens = NUM_PROMPTS * NEW_TOKENS
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average before: {os.getloadavg()[0]:.2f}; {NUM_PROMPTS} prompts "
        f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens) x {NEW_TOKENS} new tokens\n"
        f"decode-shaped matmul now: fp32 {matmul_gflops(torch.float32):.0f} GFLOP/s, bf16 "
        f"{matmul_gflops(torch.bfloat16):.0f} (FACTS.md, quiet machine: 215 and 589)"
    )
    rows = []
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        model = load_model("default", dtype)
        model.generation_config.eos_token_id = None  # exactly NEW_TOKENS per row
        engine = LocalEngine(model, eos_token_ids=[], dtype=dtype)
        time_hf_generate(model, prompts[:4], tokenizer.pad_token_id)  # warm-up
        await time_engine(engine, prompts[:4])
        hf_s, engine_s = [], []
        for _ in range(args.repeats):
            hf_s.append(time_hf_generate(model, prompts, tokenizer.pad_token_id))
            engine_s.append(await time_engine(engine, prompts))
        await engine.stop()
        rows.append((dtype, tokens / min(hf_s), tokens / min(engine_s)))
        del model, engine

    print("\n| dtype | HF generate tok/s | LocalEngine tok/s | ratio |")
    print("|---|---:|---:|---:|")
    for dtype, hf, local in rows:
        print(f"| {dtype} | {hf:.0f} | {local:.0f} | {local / hf:.2f}x |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
