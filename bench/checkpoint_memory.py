"""What a recover checkpoint leaves in the driver's memory under the Ray scheduler, and
what `runtime.release_free_memory` gives back, measured one after the other in one run.

Claim measured: the driver fetches the full trainer state from rank 0 for every
checkpoint (model + AdamW, 1.6 GB for SmolLM2-135M in float32); once written and
dropped, glibc keeps most of it in the heap (tune_malloc asks it to), until
`malloc_trim` hands it back. The loop's Saver trims after each checkpoint.

Setup: `start_ray_actors` with the default model, 2 gloo trainer ranks and 1 local engine
replica on this machine; the driver's RSS (from /proc) before, after fetching and
dropping `trainer.state_dict()`, and after `release_free_memory()`.

    .venv/bin/python bench/checkpoint_memory.py
"""

from __future__ import annotations

import asyncio
import gc
import logging
import tempfile

from looprl import startup
from looprl.config import load_config
from looprl.runtime import release_free_memory
from looprl.scheduling.ray import start_ray_actors


class Idle:
    async def run(self, data, **kw) -> float:
        return 0.0


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 2**20


async def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        cfg = load_config(
            None, [f"run.fileroot={root}", "scheduler.type=ray", "scheduler.trainer_ranks=2"]
        )
        async with start_ray_actors(startup.start(cfg), Idle()) as parts:
            before = rss_gib()
            state = await parts.trainer.state_dict()
            fetched = rss_gib()
            del state
            gc.collect()
            dropped = rss_gib()
            release_free_memory()
            trimmed = rss_gib()
    print(f"driver RSS before the checkpoint state: {before:.2f} GiB")
    print(f"  holding it:                           {fetched:.2f} GiB")
    print(f"  after dropping it:                    {dropped:.2f} GiB")
    print(f"  after release_free_memory():          {trimmed:.2f} GiB")
    print(
        f"kept after the drop, trimmed vs not: {trimmed - before:.2f} vs {dropped - before:.2f} "
        f"GiB ({(trimmed - before) / max(dropped - before, 1e-9):.2f}x)"
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main())
