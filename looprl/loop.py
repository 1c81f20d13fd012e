"""The training loop: rollouts -> batch -> train_step -> weights to the engine -> metrics.

Read top to bottom, `train` is the whole of RL in looprl. Everything it calls is a
part with its own file: the rollout controller (synchronous when
`rollout.max_head_offpolicyness = 0`, the same code path otherwise), the trainer, the
engine, the metrics. Evaluation runs the user's workflow greedily on the held-out split
at the start, every `eval.every_steps` steps and at the end.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from looprl.collect import workflow_for
from looprl.config import Config
from looprl.metrics import Metrics
from looprl.models import DEFAULT_MODEL, DEFAULT_MODEL_NAME, load_model
from looprl.rollout import RolloutController
from looprl.scheduling.local import launch_local
from looprl.tasks import load_task
from looprl.training.batch import build_batch, sample_staleness
from looprl.training.trainer import Trainer

log = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    accuracy_before: float
    accuracy_after: float
    minutes: float
    steps: int
    run_dir: Path
    model_dir: Path

    def line(self) -> str:
        return (
            f"held-out accuracy: {100 * self.accuracy_before:.1f}% -> "
            f"{100 * self.accuracy_after:.1f}% in {self.minutes:.1f} min "
            f"({self.steps} steps); model saved to {self.model_dir}"
        )


async def train(cfg: Config, *, show_progress: bool = True) -> TrainSummary:
    start = time.monotonic()
    run_dir = cfg.run_dir
    cfg.save(run_dir)
    torch.manual_seed(cfg.run.seed)
    task = load_task(cfg.task)
    log.info(
        "Training %s for %d steps: %d prompts x %d samples per step (%s), task %s, run dir %s",
        DEFAULT_MODEL_NAME if cfg.model.path == DEFAULT_MODEL else cfg.model.path,
        cfg.train.total_steps,
        cfg.rollout.batch_size,
        cfg.rollout.group_size,
        cfg.train.algorithm,
        cfg.task.name,
        run_dir,
    )
    policy = load_model(cfg.model.path, cfg.model.dtype)
    reference = load_model(cfg.model.path, cfg.model.dtype) if cfg.train.kl_coef > 0 else None
    trainer = Trainer(
        policy, cfg.train, temperature=cfg.sampling.temperature or 1.0, ref_model=reference
    )
    async with launch_local(cfg, workflow_for(cfg, task), model=policy) as parts:
        controller, engine, tokenizer = parts.controller, parts.engine, parts.tokenizer
        with Metrics(run_dir, cfg.train.total_steps, show_progress=show_progress) as metrics:
            metrics.status("evaluating the initial policy")
            before = await evaluate(controller, task.eval, cfg, metrics, step=0)
            rows = _endless(task.train, cfg.run.seed)
            for step in range(1, cfg.train.total_steps + 1):
                step_start = time.monotonic()
                metrics.status(f"rolling out {cfg.rollout.batch_size} x {cfg.rollout.group_size}")
                rollout = await controller.prepare_batch(rows)
                batch, batch_stats = build_batch(
                    rollout.trajectories, cfg.train.algorithm, tokenizer.pad_token_id
                )
                staleness = sample_staleness(batch, trainer.version).float()  # (N,)
                metrics.status("training")
                train_stats = await train_step(trainer, batch, engine, cfg)
                controller.notify_version()
                metrics.log(
                    "train",
                    step,
                    {
                        **rollout.stats(),
                        **batch_stats,
                        **train_stats,
                        "response_length": batch_stats["num_sampled_tokens"] / len(batch.rewards),
                        "staleness_mean": float(staleness.mean()),
                        "staleness_max": float(staleness.max()),
                        "step_time_s": time.monotonic() - step_start,
                    },
                )
                if (
                    cfg.eval.every_steps
                    and step % cfg.eval.every_steps == 0
                    and (step < cfg.train.total_steps)
                ):
                    metrics.status("evaluating")
                    await evaluate(controller, task.eval, cfg, metrics, step=step)
            metrics.status("final evaluation")
            after = await evaluate(controller, task.eval, cfg, metrics, step=cfg.train.total_steps)
            plot = metrics.plot()
    model_dir = save_policy(trainer.model, tokenizer, run_dir / "model")
    log.info("Saved the trained policy to %s and the reward plot to %s", model_dir, plot)
    return TrainSummary(
        before, after, (time.monotonic() - start) / 60, cfg.train.total_steps, run_dir, model_dir
    )


async def train_step(trainer: Trainer, batch, engine, cfg: Config) -> dict[str, float]:
    """One update, then the new weights to the engine (generations in flight go on).

    The engine pauses at a token boundary while the trainer holds the cores, and the step
    runs in a worker thread so that the event loop stays live: workflows, the gateway and
    every timeout go on meanwhile (with the step on the loop's thread, a client's 5 s
    connect timeout fired on a healthy request). The thread itself costs nothing
    (`bench/train_step_thread.py`: 15.18 vs 15.16 s a step); Python running on the loop
    at the same time, e.g. the rollouts of asynchronous RL, slows the step ~1.25x (GIL).
    """
    await engine.pause()
    try:
        stats = await asyncio.to_thread(trainer.train_step, batch)
        await engine.update_weights(trainer.state_dict_for_engine(), trainer.version)
    finally:
        await engine.resume()
    return stats


async def evaluate(
    controller: RolloutController, rows: list[dict], cfg: Config, metrics: Metrics, *, step: int
) -> float:
    """Greedy held-out accuracy of the current policy, through the user's workflow."""
    rows = rows[: cfg.eval.size] if cfg.eval.size else rows
    if not rows:
        log.warning("No held-out rows: accuracy is reported as 0; set task.eval_path")
        return 0.0
    result = await controller.rollout_batch(
        rows,
        group_size=1,
        sampling_overrides={"temperature": 0.0, "max_tokens": cfg.eval.max_new_tokens},
    )
    stats = result.stats()
    metrics.log("eval", step, stats)
    return stats["accuracy"] if stats["accuracy"] == stats["accuracy"] else 0.0


def save_policy(model: torch.nn.Module, tokenizer, out: Path) -> Path:
    """Save as a Hugging Face folder (safetensors, tokenizer, chat template)."""
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _endless(rows: list[dict], seed: int) -> Iterator[dict]:
    """Shuffled passes over the training rows, forever (one epoch after another)."""
    rng = random.Random(seed)
    while True:
        order = list(rows)
        rng.shuffle(order)
        yield from order
