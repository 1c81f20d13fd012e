"""`looprl sft`: supervised fine-tuning on chats, to warm-start a policy before RL.

The same trainer, loss masks and output folder as `looprl train`: each chat's assistant
tokens (sft_data.py) are trained with the policy-gradient loss at advantage 1 and a
single update per batch, whose gradient is exactly that of the mean negative
log-likelihood of those tokens (the ratio is 1 with gradient d log pi). LoRA, precision,
micro-batching, the learning-rate schedule and activation checkpointing are
`train.*`/`model.*` as in RL. Held-out chats (`sft.eval_path`) are scored by their loss
per token (`nll`) at the start, every `eval.every_steps` steps and at the end. Not
resumable: an interrupted run starts again.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from looprl import startup
from looprl.config import Config
from looprl.runs.metrics import Metrics
from looprl.scheduling.parts import build_trainer
from looprl.training.batch import TrainBatch, build_batch
from looprl.training.policy_folder import save_policy
from looprl.training.sft_data import load_chats
from looprl.training.trainer import Trainer
from looprl.types import Trajectory

log = logging.getLogger(__name__)


@dataclass
class SftSummary:
    nll_before: float | None
    nll_after: float | None
    steps: int
    minutes: float
    model_dir: Path

    def line(self) -> str:
        held_out = (
            f"held-out loss per token: {self.nll_before:.3f} -> {self.nll_after:.3f}, "
            if self.nll_before is not None
            else ""
        )
        return (
            f"{held_out}{self.steps} steps in {self.minutes:.1f} min; model saved to "
            f"{self.model_dir}"
        )


def check(cfg: Config) -> None:
    """Refuse what SFT does not do, before anything loads."""
    if not cfg.sft.data_path:
        raise ValueError("looprl sft needs sft.data_path: a JSONL file of chats")
    if cfg.train.kl_coef > 0:
        raise ValueError(f"train.kl_coef={cfg.train.kl_coef:g} is RL's; set it to 0 for sft")
    if cfg.train.algorithm == "distill":
        raise ValueError("train.algorithm=distill is RL's (looprl train); sft needs none")


def run_sft(cfg: Config, *, show_progress: bool = True) -> SftSummary:
    check(cfg)
    start = time.monotonic()
    # One update per batch at temperature 1, no truncation: the loss is the likelihood's.
    train_cfg = cfg.train.model_copy(
        update={"mismatch_correction": "none", "ppo_epochs": 1, "mini_batches": 1}
    )
    sampling = cfg.sampling.model_copy(update={"temperature": 1.0, "top_k": 0, "top_p": 1.0})
    setup = startup.start(cfg.model_copy(update={"train": train_cfg, "sampling": sampling}))
    run_dir = setup.paths.root
    cfg.save(setup.paths)
    torch.manual_seed(cfg.run.seed)
    tokenizer = setup.model.tokenizer
    train_chats = load_chats(cfg.sft.data_path, tokenizer, cfg.sft.max_tokens)
    held_out = (
        load_chats(cfg.sft.eval_path, tokenizer, cfg.sft.max_tokens).trajectories
        if cfg.sft.eval_path
        else []
    )
    rows = train_chats.trajectories
    steps_per_epoch = math.ceil(len(rows) / cfg.sft.batch_size)
    total_steps = cfg.sft.epochs * steps_per_epoch
    setup = replace(
        setup,
        cfg=setup.cfg.model_copy(
            update={"train": train_cfg.model_copy(update={"total_steps": total_steps})}
        ),
    )
    model = setup.model.load(cfg.model.dtype).to(setup.device)
    trainer = build_trainer(setup, model)
    log.info(
        "Fine-tuning on %d chats of %s (%d lines skipped), %d held out: %d epochs x %d "
        "steps of %d chats, run dir %s",
        len(rows),
        train_chats.path,
        len(train_chats.skipped),
        len(held_out),
        cfg.sft.epochs,
        steps_per_epoch,
        cfg.sft.batch_size,
        run_dir,
    )
    pad = tokenizer.pad_token_id
    order = random.Random(cfg.run.seed)
    with Metrics(setup.paths, total_steps, show_progress=show_progress) as metrics:
        before = _evaluate(trainer, held_out, pad, metrics, step=0)
        step = 0
        for _ in range(cfg.sft.epochs):
            shuffled = order.sample(rows, len(rows))
            for first in range(0, len(shuffled), cfg.sft.batch_size):
                step += 1
                batch = sft_batch(shuffled[first : first + cfg.sft.batch_size], pad)
                stats = trainer.train_step(batch)
                metrics.log(
                    "train",
                    step,
                    {
                        "nll": -stats["logprob_mean"],
                        "loss": stats["loss"],
                        "grad_norm": stats["grad_norm"],
                        "lr": stats["lr"],
                        "tokens_per_s": stats["tokens_per_s"],
                        "num_sampled_tokens": batch.num_sampled_tokens,
                        "skipped_rows": len(train_chats.skipped),
                        "version": stats["version"],
                        "step_time_s": stats["train_time_s"],
                    },
                )
                every = cfg.eval.every_steps
                if every and step % every == 0 and step < total_steps:
                    _evaluate(trainer, held_out, pad, metrics, step=step)
        after = _evaluate(trainer, held_out, pad, metrics, step=total_steps)
    model_dir = save_policy(
        trainer.model, tokenizer, setup.paths.model, merged=cfg.model.lora.save_merged
    )
    log.info("Saved the fine-tuned policy to %s", model_dir)
    return SftSummary(before, after, total_steps, (time.monotonic() - start) / 60, model_dir)


def sft_batch(rows: list[Trajectory], pad_token_id: int) -> TrainBatch:
    """Chats padded into a TrainBatch with advantage 1 on every row."""
    batch, _ = build_batch(rows, "grpo", pad_token_id)
    return replace(batch, advantages=torch.ones(batch.num_sequences))


def _evaluate(
    trainer: Trainer, rows: list[Trajectory], pad: int, metrics: Metrics, *, step: int
) -> float | None:
    """Held-out loss per assistant token (mean negative logprob), logged as `nll`."""
    if not rows:
        return None
    batch = sft_batch(rows, pad)
    logprobs = trainer.compute_logprobs(batch)  # (N, T)
    nll = float(-logprobs[batch.loss_mask].mean())
    metrics.log("eval", step, {"nll": nll, "num_rows": len(rows)})
    return nll
