"""Writing and loading a recover checkpoint vs a bare `torch.save` of the same state.

Claim measured: what atomic, checksummed checkpoints (`looprl/runs/checkpoint.py`: temporary
folder, fsync of every file, sha256 manifest, rename, `latest` pointer, pruning) cost
over `torch.save` alone, for SmolLM2-135M-Instruct's trainer state (fp32 weights and
AdamW moments after one optimizer step, ~1.6 GB). Best of `--repeats`, each into a
fresh folder on the same disk; loading includes verifying every sha256.

    .venv/bin/python bench/checkpoint_save.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from looprl.config import Config, TrainConfig
from looprl.models import default_model_dir, load_model
from looprl.runs import checkpoint as ck
from looprl.training.trainer import Trainer


def trainer_state() -> dict:
    trainer = Trainer(load_model(default_model_dir()), TrainConfig(compute_dtype="float32"))
    for p in trainer.params:  # one optimizer step, so the Adam moments exist
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    return trainer.state_dict()


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(repeats: int) -> None:
    state = trainer_state()
    config = Config().model_dump(mode="json")
    loop_state = {"data_position": 0, "rng": ck.rng_state()}
    root = Path(tempfile.mkdtemp(dir="."))
    try:
        counter = iter(range(10**6))

        def bare() -> None:
            torch.save(state, root / f"bare-{next(counter)}.pt")

        def ours() -> None:
            ck.save(root / f"run-{next(counter)}", 1, state, loop_state, config, keep_last=2)

        run_dir = root / "load"
        ck.save(run_dir, 1, state, loop_state, config, keep_last=2)
        size = sum(f.stat().st_size for f in (run_dir / "checkpoints/step_000001").iterdir())
        t_bare, t_ours = best(bare, repeats), best(ours, repeats)
        t_load = best(lambda: ck.load_latest(run_dir), repeats)
    finally:
        shutil.rmtree(root)
    print(f"\ncheckpoint of {size / 1e9:.2f} GB, best of {repeats}")
    print("| operation | s | vs torch.save |")
    print("|---|---:|---:|")
    print(f"| torch.save (baseline) | {t_bare:.2f} | 1.00x |")
    print(f"| checkpoint.save (fsync, sha256, rename) | {t_ours:.2f} | {t_ours / t_bare:.2f}x |")
    print(f"| checkpoint.load_latest (sha256 verified) | {t_load:.2f} | {t_load / t_bare:.2f}x |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    main(parser.parse_args().repeats)
