"""The local engine on a GPU with and without CUDA graphs, against Hugging Face
`generate` (a device check of engine.cuda_graphs, docs/gpu.md).

The GPU check (bench/gpu_check.py) measured the engine at 1.27x `generate` on one H200
(256 prompts x 512 tokens, bf16, portable kernels, no graphs): ~65 ms a step for a 135M
model whose weights and K/V are read in well under a millisecond. The profiler put 58%
of the host's time in cuDNN's attention planning a new shape each step (one width per
step: WIDTH_STEP now rounds it) and the rest in launching ~600 kernels one Python call
each (CUDA graphs now replay them). This runs the engine both ways and `generate` on a
model of SmolLM2-135M's shape with random weights (no download), random prompts,
sampling at temperature 1, EOS ignored; the last line is every figure as JSON, with the
share of the GPU's memory bandwidth a decode step reaches.

    python3 bench/gpu_engine.py --device cuda                   # on the GPU machine
    .venv/bin/python bench/gpu_engine.py --device cpu --quick   # a dry run here (eager)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from looprl.engines.local.engine import LocalEngine
from looprl.types import SamplingParams

SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="HBM, H200's")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, prompt_len, new_tokens = (8, 16, 8) if args.quick else (256, 48, 512)
    out: dict = {"device": str(device), "rows": b, "prompt": prompt_len, "new": new_tokens}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompts = torch.randint(100, 40000, (b, prompt_len)).tolist()
    graphs = "cuda" if device.type == "cuda" else "eager"

    # A. The engine end to end, with and without CUDA graphs.
    def engine(mode: str) -> LocalEngine:
        return LocalEngine(
            model, eos_token_ids=[], dtype=str(dtype).removeprefix("torch."),
            kernels="portable", graphs=mode, max_batch_size=b,
            max_tokens_per_batch=b * (prompt_len + new_tokens + 64),
        )  # fmt: skip

    async def generate(e: LocalEngine, n: int) -> float:
        sampling = SamplingParams(max_new_tokens=n, temperature=1.0)
        start = time.perf_counter()
        await asyncio.gather(*(e.generate(p, sampling) for p in prompts))
        return time.perf_counter() - start

    async def engine_part(mode: str) -> None:
        e = engine(mode)
        first = await generate(e, new_tokens)  # captures its graphs as shapes come up
        seconds = await generate(e, new_tokens)
        out[f"engine_{mode}_first_s"] = round(first, 2)
        out[f"engine_{mode}_s"] = round(seconds, 2)
        out[f"engine_{mode}_tokens_per_s"] = round(b * new_tokens / seconds)
        if e._runner.graphs is not None:
            out[f"engine_{mode}_graphs"] = e._runner.graphs.captures
        if mode == graphs:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                steps = 32 if not args.quick else 4
                seconds = await generate(e, steps)
            out["graphs_profiled_ms_per_step"] = round(1000 * seconds / steps, 2)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        await e.stop()

    asyncio.run(engine_part(graphs))
    asyncio.run(engine_part("off"))

    # B. Hugging Face generate, the same prompts and sampling, in the engine's dtype.
    hf = model.to(dtype)
    ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        hf.generate(input_ids=ids[:4], do_sample=True, max_new_tokens=8, top_k=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        hf.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
            max_new_tokens=new_tokens, top_k=0, temperature=1.0,
        )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    hf_s = time.perf_counter() - start
    out["hf_s"] = round(hf_s, 2)
    out["hf_tokens_per_s"] = round(b * new_tokens / hf_s)
    for mode in (graphs, "off"):
        out[f"engine_{mode}_vs_hf"] = round(hf_s / out[f"engine_{mode}_s"], 2)
    # Bytes a decode step reads: the weights once, and the K/V of every row (mean length).
    weight_bytes = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    cfg = model.config
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 64 * dtype.itemsize
    kv_bytes = b * (prompt_len + new_tokens / 2) * kv_per_token
    step_s = out[f"engine_{graphs}_s"] / new_tokens
    out["decode_gb_per_step"] = round((weight_bytes + kv_bytes) / 1e9, 3)
    out["bandwidth_share"] = round((weight_bytes + kv_bytes) / step_s / 1e9 / args.bandwidth_gbs, 4)
    print("GPU_PROFILE " + json.dumps(out))


if __name__ == "__main__":
    main()
