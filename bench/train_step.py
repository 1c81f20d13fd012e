"""The trainer's step on the default job's batch: tokens not computed vs every token.

Claim measured, in one run on the same machine: running a group's shared prompt once
with its rows packed after it (no padding), in micro-batches of whole groups, and
leaving out rows with zero advantage (`looprl/training/shared_prefix.py`, `trainer.py`)
gives the same update in less time than the padded forward over every row.

The batch has the default job's shape: 8 arithmetic prompts in SmolLM2's chat template
(the default system prompt, 38 tokens) x 8 samples of 20-59 sampled tokens, rewards
0/1 with two groups all-equal (zero advantage), as in the first steps of `make demo`.
Both sides run `Trainer.train_step` on a copy of the same model (AdamW, lr 2e-5) after a
warm-up step, `--repeats` times; the best is reported (other load only slows a run).
The baseline is the same trainer with both optimizations switched off.

    .venv/bin/python bench/train_step.py                       # precision: auto
    LOOPRL_FORCE_CPU=avx2 .venv/bin/python bench/train_step.py # as on an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import copy
import time
from contextlib import contextmanager

import torch

from looprl import startup
from looprl.config import TrainConfig, load_config
from looprl.models import load_model, load_tokenizer
from looprl.precision import cpu
from looprl.training import shared_prefix
from looprl.training import trainer as trainer_module
from looprl.training.batch import TrainBatch, build_batch
from looprl.training.trainer import Trainer
from looprl.types import Trajectory


def default_job_batch(tokenizer) -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    trajectories = []
    for p in range(8):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {p} * {p + 1}?"}],
            add_generation_prompt=True,
            return_dict=False,
        )
        for s in range(8):
            n = int(torch.randint(20, 60, (1,), generator=gen))
            ids = torch.tensor(prompt + torch.randint(100, 40000, (n,), generator=gen).tolist())
            mask = torch.arange(len(ids)) >= len(prompt)
            reward = float(p >= 2 and s % 2)  # groups 0 and 1: all zero
            trajectories.append(
                Trajectory(
                    ids,
                    mask,
                    torch.where(mask, -2.0, 0.0),
                    torch.where(mask, 0, -1),
                    reward,
                    group_id=str(p),
                )  # fmt: skip
            )
    return build_batch(trajectories, "grpo", tokenizer.pad_token_id)[0]


@contextmanager
def every_token():
    """The baseline: the padded forward over every row."""
    supports, rows = shared_prefix.supports, trainer_module._rows_with_gradient
    shared_prefix.supports = lambda model: False
    trainer_module._rows_with_gradient = lambda batch: torch.arange(len(batch.lengths))
    try:
        yield
    finally:
        shared_prefix.supports, trainer_module._rows_with_gradient = supports, rows


def best_step_s(trainer: Trainer, batch: TrainBatch, repeats: int) -> float:
    trainer.train_step(batch)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        trainer.train_step(batch)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    tokenizer, model = load_tokenizer("default"), load_model("default")
    batch = default_job_batch(tokenizer)
    cfg = TrainConfig()
    decided = startup.start(load_config(None, [])).precision.train  # train.compute_dtype=auto
    ours = Trainer(copy.deepcopy(model), cfg, precision=decided)
    print(f"{cpu().describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(ours.precision.describe())
    print(
        f"batch: {batch.num_sequences} rows, {batch.num_tokens} tokens "
        f"({batch.num_sampled_tokens} sampled), padded {tuple(batch.input_ids.shape)}, "
        f"{int((batch.advantages == 0).sum())} rows with zero advantage"
    )
    with every_token():
        baseline = Trainer(copy.deepcopy(model), cfg, precision=decided)
        baseline_s = best_step_s(baseline, batch, args.repeats)
    ours_s = best_step_s(ours, batch, args.repeats)
    print("| trainer | train_step | tokens/s (all batch tokens) | speed-up |")
    print("|---|---:|---:|---:|")
    tokens = batch.num_tokens
    print(f"| every token, padded | {baseline_s:.1f} s | {tokens / baseline_s:.0f} | 1.00x |")
    print(
        f"| shared prompts packed, zero-advantage rows left out | {ours_s:.1f} s | "
        f"{batch.num_tokens / ours_s:.0f} | {baseline_s / ours_s:.2f}x |"
    )


if __name__ == "__main__":
    main()
