"""The local engine's design choices, each measured against the alternative it replaced.

Claims measured (SmolLM2-135M-Instruct in bfloat16 unless stated; best of N timings):
1. a fused decode step runs faster on the thread that ran torch first than from a
   worker thread (a second OpenMP team);
2. sampling 64 rows is faster with glibc told to keep large freed blocks
   (`looprl.runtime.tune_malloc`), measured in two subprocesses, with and without;
3. decode attention (one query row) is faster as two batched matmuls than through
   `scaled_dot_product_attention`; and, for the portable kernels, which run SDPA, giving
   it each KV head's query heads as query rows beats `enable_gqa`;
4. with K stored as (head_dim, T), attending to the first `width` columns needs no copy;
   with K as (T, head_dim) the sliced transpose makes bmm copy K first;
5. oneDNN-packed weights (`mkldnn._linear_pointwise`) beat `F.linear` on decode shapes;
6. `torch.compile` of the RMSNorm does not pay at decode sizes (compile time, per call);
7. the fused bf16 forward's logprob error against float32 is that of Hugging Face's own
   bf16 forward (mean and max absolute difference on the same sampled tokens).

    .venv/bin/python bench/engine_choices.py
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F

from looprl.engines.local.fused import FusedDecoder, _pack
from looprl.engines.local.kv_cache import SlotCache
from looprl.models import load_model

BATCH, PROMPT, VOCAB = 32, 40, 49152


def best_us(fn, repeats: int = 20, rounds: int = 3) -> float:
    """Best mean over `rounds` of `repeats` calls, in microseconds."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e6


def row(name: str, ours: float, theirs: float, unit: str = "us") -> None:
    print(
        f"| {name} | {ours:.0f} {unit} | {theirs:.0f} {unit} | {theirs / ours:.2f}x |", flush=True
    )


def decoder_at_batch(model, batch: int, columns: int):
    decoder = FusedDecoder(model)
    cache = SlotCache(decoder, batch * columns)
    cache.reserve(batch, columns)
    slots = torch.arange(batch)
    ids = torch.randint(0, VOCAB, (batch, PROMPT))
    decoder.prefill(cache, ids, torch.full((batch,), PROMPT), slots)
    tokens = torch.randint(0, VOCAB, (batch,))
    positions = torch.full((batch,), PROMPT)
    return lambda: decoder.decode(cache, tokens, positions, slots)


def threads(model) -> None:
    step = decoder_at_batch(model, BATCH, 128)
    main = best_us(step, repeats=10)
    result = {}
    worker = threading.Thread(target=lambda: result.update(us=best_us(step, repeats=10)))
    worker.start()
    worker.join()
    row(f"decode step, batch {BATCH}: main thread vs worker thread", main, result["us"])


def sampling_child(tune: bool) -> None:
    """Runs in a subprocess: time the engine's sampler on 64 rows, print microseconds."""
    from looprl.engines.local.sampling import sample
    from looprl.runtime import tune_malloc
    from looprl.types import SamplingParams

    if tune:
        tune_malloc()  # as LocalEngine does when it is built
    logits = torch.randn(64, VOCAB) * 3
    params, generator = [SamplingParams(8)] * 64, torch.Generator().manual_seed(0)
    print(best_us(lambda: sample(logits, params, generator, [None] * 64)))


def sampling() -> None:
    us = {}
    for tune in (True, False):
        cmd = [sys.executable, __file__, "--sampling-child", str(int(tune))]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        us[tune] = float(out.strip().splitlines()[-1])
    row("sample 64 rows: malloc tuned vs glibc default", us[True], us[False])


def attention() -> None:
    slots, kv, group, d, width, columns = BATCH, 3, 3, 64, 100, 192
    q = torch.randn(slots, kv, group, d, dtype=torch.bfloat16)
    k_td = torch.randn(slots, kv, columns, d, dtype=torch.bfloat16)  # K as (T, head_dim)
    k_dt = k_td.transpose(-1, -2).contiguous()  # K as (head_dim, T), the engine's layout
    v = torch.randn(slots, kv, columns, d, dtype=torch.bfloat16)

    def matmuls(keys_t):
        probs = torch.matmul(q, keys_t).softmax(dim=-1)
        return torch.matmul(probs, v[:, :, :width])

    sdpa_q = q.reshape(slots, kv * group, 1, d)
    sdpa = best_us(
        lambda: F.scaled_dot_product_attention(
            sdpa_q, k_td[:, :, :width], v[:, :, :width], enable_gqa=True
        )
    )
    ours = best_us(lambda: matmuls(k_dt[..., :width]))
    row(f"decode attention per layer ({slots} rows, {width} columns): matmuls vs SDPA", ours, sdpa)
    sliced_td = best_us(lambda: matmuls(k_td[:, :, :width].transpose(-1, -2)))
    row(f"same, K as (head_dim, T) vs (T, head_dim), {width}/{columns} columns", ours, sliced_td)

    # The portable kernels' decode: SDPA with a mask row per slot, K as (T, head_dim).
    lengths = torch.randint(1, width + 1, (slots,))
    visible = (torch.arange(width) < lengths[:, None])[:, None, None, :]
    keys, values = k_td[:, :, :width], v[:, :, :width]
    grouped = best_us(lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=visible))
    gqa = best_us(
        lambda: F.scaled_dot_product_attention(
            sdpa_q, keys, values, attn_mask=visible, enable_gqa=True
        )
    )
    row("masked SDPA: a KV head's query heads as its query rows vs enable_gqa", grouped, gqa)


def packed_linear() -> None:
    shapes = [(576, 960, "qkv"), (576, 3072, "gate+up"), (1536, 576, "down")]
    shapes.append((576, VOCAB, "LM head"))
    for dtype in (torch.bfloat16, torch.float32):
        for k, n, name in shapes:
            x = torch.randn(BATCH, k, dtype=dtype)
            w = torch.randn(n, k, dtype=dtype)
            packed = _pack(w)
            ours = best_us(
                lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            )
            theirs = best_us(lambda x=x, w=w: F.linear(x, w))
            row(
                f"{name} {str(dtype)[6:]} ({BATCH}x{k} @ {k}x{n}): packed vs F.linear", ours, theirs
            )


def compiled_norm() -> None:
    def norm(x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + 1e-5)).to(x.dtype)

    x = torch.randn(BATCH, 576, dtype=torch.bfloat16)
    w = torch.randn(576, dtype=torch.bfloat16)
    start = time.perf_counter()
    compiled = torch.compile(norm, dynamic=True)
    compiled(x, w)
    print(f"torch.compile(RMSNorm, dynamic=True): {time.perf_counter() - start:.0f} s to compile")
    row(
        "RMSNorm per call: eager vs torch.compile",
        best_us(lambda: norm(x, w), 200),
        best_us(lambda: compiled(x, w), 200),
    )


@torch.inference_mode()
def bf16_error() -> None:
    torch.manual_seed(0)
    fp32 = load_model("default").eval()
    bf16 = load_model("default", "bfloat16").eval()
    decoder = FusedDecoder(bf16)
    cache = SlotCache(decoder, 4 * 128)
    cache.reserve(4, 128)
    sequences = [torch.randint(0, VOCAB, (n,)).tolist() for n in (30, 50, 41, 20)]
    width = max(map(len, sequences))
    ids = torch.zeros(4, width, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
    lengths, slots = torch.tensor([len(s) for s in sequences]), torch.arange(4)
    logits = [decoder.prefill(cache, ids, lengths, slots)]
    for step in range(10):
        tokens = torch.distributions.Categorical(logits=logits[-1]).sample()
        for i, s in enumerate(sequences):
            s.append(int(tokens[i]))
        if step < 9:
            logits.append(decoder.decode(cache, tokens, lengths + step, slots))
    fused_err, hf_err = [], []
    for r, s in enumerate(sequences):
        ref = torch.log_softmax(fp32(torch.tensor([s])).logits[0].float(), -1)
        hf = torch.log_softmax(bf16(torch.tensor([s])).logits[0].float(), -1)
        for t in range(10):
            pos, token = int(lengths[r]) - 1 + t, s[int(lengths[r]) + t]
            fused = torch.log_softmax(logits[t][r], -1)[token]
            fused_err.append(abs(float(fused - ref[pos, token])))
            hf_err.append(abs(float(hf[pos, token] - ref[pos, token])))
    for name, err in (("fused bf16", fused_err), ("Hugging Face bf16", hf_err)):
        print(
            f"{name} logprob vs float32 ({len(err)} tokens): mean {sum(err) / len(err):.3f}, "
            f"max {max(err):.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sampling-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sampling_child is not None:
        sampling_child(bool(args.sampling_child))
        return
    print("| choice | ours | the alternative | speed-up |\n|---|---:|---:|---:|")
    model = load_model("default", "bfloat16").eval()
    threads(model)  # first: the main thread must be the first to run torch ops
    sampling()
    attention()
    packed_linear()
    compiled_norm()
    bf16_error()


if __name__ == "__main__":
    main()
