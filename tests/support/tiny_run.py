"""A short `looprl train` of a tiny test model: the overrides the integration and e2e
tests share, and the run's metrics records read back.

`TINY_RUN` is two steps of 2 prompts x 2 samples of 4 tokens, float32 engine and
trainer, evaluated before training and after the last step (eval.every_steps=0). A test
passes what makes it its own as overrides, which win over these. `tests/conftest.py`'s
`tiny_run` fixture binds `tiny_run_config` to `tiny_model_dir` and the test's tmp_path.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from looprl.config import Config, load_config
from looprl.loop import train

if TYPE_CHECKING:
    from looprl.loop import TrainSummary

TINY_RUN = (
    "engine.dtype=float32",
    "train.compute_dtype=float32",
    "train.total_steps=2",
    "rollout.batch_size=2",
    "rollout.group_size=2",
    "sampling.max_new_tokens=4",
    "eval.every_steps=0",
    "eval.max_new_tokens=4",
)


def tiny_run_overrides(model_dir: str | Path, root: str | Path, *overrides: str) -> list[str]:
    """`looprl train`'s overrides for `model_dir` with run dirs under `root`: TINY_RUN,
    then `overrides`. One entry per key: a later value takes an earlier one's place, so
    the list reads as a command line too."""
    merged: dict[str, str] = {}
    for item in (f"model.path={model_dir}", f"run.fileroot={root}", *TINY_RUN, *overrides):
        merged[item.partition("=")[0]] = item
    return list(merged.values())


def tiny_run_config(model_dir: str | Path, root: str | Path, *overrides: str) -> Config:
    """The Config of `tiny_run_overrides(model_dir, root, *overrides)`."""
    return load_config(None, tiny_run_overrides(model_dir, root, *overrides))


def metrics_records(run_dir: Path, kind: str) -> list[dict]:
    """The records of `kind` ("train", "eval") in `run_dir`'s metrics.jsonl, in order."""
    with (run_dir / "metrics.jsonl").open() as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


async def train_and_read(cfg: Config) -> tuple[TrainSummary, list[dict], list[dict]]:
    """Train `cfg`; (summary, train records, eval records)."""
    summary = await train(cfg, show_progress=False)
    return summary, metrics_records(cfg.run_dir, "train"), metrics_records(cfg.run_dir, "eval")


async def train_two_steps(cfg: Config) -> tuple[TrainSummary, list[dict], list[dict]]:
    """`train_and_read(cfg)` of a two-step run, checked: the training took under a minute
    and trained steps 1 and 2."""
    start = time.monotonic()
    summary = await train(cfg, show_progress=False)
    assert time.monotonic() - start < 60
    steps = metrics_records(cfg.run_dir, "train")
    assert [r["step"] for r in steps] == [1, 2]
    return summary, steps, metrics_records(cfg.run_dir, "eval")


async def train_tool_agent_two_steps(
    tool_model_dir: Path, tmp_path: Path, agent: type, *overrides: str
) -> None:
    """Train the calculator agent class `agent` two steps on the tool model (2 prompts x 2
    samples), checked: every rollout completed and was trained on as one sample, none
    dropped, tools called; greedy before training, each held-out rollout ran a tool."""
    cfg = tiny_run_config(
        tool_model_dir,
        tmp_path,
        f"workflow.path={agent.__module__}:{agent.__name__}",
        "sampling.max_new_tokens=40",  # a call and its arguments
        "eval.size=2",
        "eval.max_new_tokens=40",
        *overrides,
    )
    _, steps, evals = await train_two_steps(cfg)  # in under a minute
    for record in steps:
        assert record["rollouts"] == record["completed"] == 4 and record["errors"] == {}, record
        assert record["left_out_rollouts"] == 0 and record["filtered_groups"] == 0
        assert record["dropped_stale_groups"] == 0 and record["trajectories_pruned"] == 0
        assert record["concat_breaks"] == 0 and record["unrewarded_calls"] == 0
        assert record["trajectories"] == record["num_sequences"] == 4  # all of it trained
        assert record["calls"] >= 4 and record["action_share_tool"] > 0  # it called tools
        assert 0.0 <= record["reward_mean"] <= 1.0 and math.isfinite(record["grad_norm"])
    assert [r["completed"] for r in evals] == [2, 2], evals  # before and after training
    # before training, greedy, each held-out rollout ran a tool (after two sampled steps
    # the tiny model's greedy choices may have moved: a call that no longer parses)
    assert evals[0]["reward_mean"] >= 0.5 and evals[0]["tool_call_errors"] == 0, evals
