"""A run directory made up from nothing, as `looprl train` lays it out: config.yaml,
metrics.jsonl and trajectories/step_NNNNNN.parquet, for the viewer's tests and bench.

Every number is a function of (step, row), so a test knows what to look for: row `r`
of step `s` has sample index `r % group_size` in group `g{s}-{r // group_size}` (the
group's rows share the dataset `row_id`); its reward is 0 on even sample indices; every
11th row has an error (and no trainer logprobs), every 7th is truncated, staleness is
`s % 3`, and row 5 has a concat break. Each row's text holds the word `needle{s}x{r}`.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from looprl.config import load_config
from looprl.runs.paths import RunPaths
from looprl.runs.trajectories import write_step

WORDS = ["the", "of", "a", "to", "and", "is", "in", "that", "it", "for", "on", "with", "as"]


def write_synthetic_run(
    run_dir: Path,
    *,
    steps: int = 20,
    rows_per_step: int = 32,
    group_size: int = 8,
    tokens_per_row: int = 200,
    eval_every: int = 10,
) -> Path:
    """Write a finished run of `steps` steps into `run_dir`; returns `run_dir`."""
    run_dir = Path(run_dir)
    load_config(
        None,
        [
            f"train.total_steps={steps}",
            f"rollout.batch_size={rows_per_step // group_size}",
            f"rollout.group_size={group_size}",
        ],
    ).save(run_dir)
    with RunPaths(run_dir).metrics.open("w") as f:
        for record in metric_records(steps, eval_every):
            f.write(json.dumps(record) + "\n")
    for step in range(1, steps + 1):
        write_step(run_dir, step, trajectory_rows(step, rows_per_step, group_size, tokens_per_row))
    return run_dir


def metric_records(steps: int, eval_every: int) -> list[dict]:
    """Train records for steps 1..`steps` with the keys the loop logs, evals every
    `eval_every` steps and at 0; `kl` is None (JSON null) on every 7th step."""
    records = []
    start = 1_790_000_000.0
    for step in range(0, steps + 1):
        t = start + 10.0 * step
        if step % eval_every == 0 or step == steps:
            accuracy = 0.5 + 0.4 * (1 - math.exp(-step / 200))
            records.append({"kind": "eval", "step": step, "time": t, "accuracy": accuracy})
        if step == 0:
            continue
        reward = 0.3 + 0.5 * (1 - math.exp(-step / 150)) + 0.05 * math.sin(step)
        records.append(
            {
                "kind": "train",
                "step": step,
                "time": t + 9.0,
                "reward_mean": reward,
                "reward_std": 0.3,
                "errors": {"ValueError": 1} if step % 11 == 0 else {},
                "loss": 0.1 * math.cos(step / 7),
                "approx_kl": 1e-3 * (1 + step % 5),
                "kl": None if step % 7 == 0 else 2e-3,
                "entropy": 2.0 - step / (steps + 1),
                "mismatch_logprob_abs_mean": 1e-3,
                "mismatch_kl_k3": 2e-4,
                "mismatch_ratio_outside_frac": 0.0,
                "staleness_mean": (step % 3) / 2,
                "staleness_max": step % 3,
                "rollout_tokens_per_s": 800 + step % 13,
                "tokens_per_s": 300 + step % 7,
                "response_length": 160.0,
                "step_time_s": 9.0,
                "version": float(step),
            }
        )
    return records


def trajectory_rows(step: int, rows: int, group_size: int, tokens: int) -> list[dict]:
    """One step's trajectories (`looprl.runs.trajectories.SCHEMA`): a 40-token prompt
    (mask 0), then the completion (mask 1), with a 10-token tool result (mask 0) in its
    middle on odd sample indices; `tokens` >= 60 (the needle is the 46th token)."""
    rng = random.Random(step)
    out = []
    for r in range(rows):
        sample = r % group_size
        words = [rng.choice(WORDS) for _ in range(tokens)]
        words[45] = f"needle{step}x{r}"
        token_text = [" " + w for w in words]
        mask = [i >= 40 for i in range(tokens)]
        if sample % 2:
            middle = tokens // 2
            mask[middle : middle + 10] = [False] * 10
        engine = [-rng.random() * 3 if m else 0.0 for m in mask]
        reward = 0.0 if sample % 2 == 0 else 1.0
        calls = [
            {
                "completion_id": f"c{step}-{r}-0",
                "messages": [{"role": "user", "content": "".join(token_text[:40])}],
                "reply": "".join(token_text[40:]),
                "tool_calls": [],
                "finish_reason": "length" if r % 7 == 0 else "stop",
                "reward": reward,
                "started_s": 0.0,
                "ended_s": 1.5,
            }
        ]
        out.append(
            {
                "step": step,
                "policy_version": step - 1,
                "session_id": f"s{step}-{r}",
                "group_id": f"g{step}-{r // group_size}",
                "row_id": f"row{step}-{r // group_size}",
                "sample_index": sample,
                "reward": reward,
                "advantage": reward - 0.5,
                "staleness": step % 3,
                "truncated": r % 7 == 0,
                "error": "ValueError: the reward function failed" if r % 11 == 0 else None,
                "text": "".join(token_text),
                "token_ids": [WORDS.index(w) if w in WORDS else 999 for w in words],
                "token_text": token_text,
                "loss_mask": mask,
                "engine_logprobs": engine,
                "trainer_logprobs": None if r % 11 == 0 else [e + 0.01 for e in engine],
                "token_versions": [step - 1 - step % 3 if m else -1 for m in mask],
                "calls": json.dumps(calls),
                "concat_breaks": json.dumps(
                    ["turn 2: the history was re-tokenized"] if r == 5 else []
                ),
                "timings": json.dumps({"rollout_s": 1.5, "wait_s": 0.01}),
            }
        )
    return out
