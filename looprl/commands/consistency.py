"""Logprob consistency: how far an engine's logprobs are from the trainer's, on the
same tokens (`looprl debug consistency`).

Owns `measure` (generate with an engine, recompute the logprobs of exactly the tokens
it sampled with `Trainer.compute_logprobs`, as the training step does, and compare)
and `check_consistency` (that, for each engine backend asked for, on the configured
model, task prompts and sampling). Reported per engine, with the function the trainer
logs every step (losses.mismatch_metrics): mean |engine - trainer| over sampled tokens,
the KL from the engine's sampling distribution to the trainer's (k3 estimator, mean of
exp(r) - 1 - r with r = trainer - engine logprob, over tokens the engine sampled:
unbiased and never negative), the fraction of tokens whose ratio pi_trainer/pi_engine
is outside [0.5, 2]; then the max |engine - trainer| and the worst tokens.

Differences come from the engine's dtype (engine.dtype: bf16 vs the trainer's float32
weights, possibly under bf16 autocast, train.compute_dtype) and its kernels. Top-k /
top-p are accounted for: the engine's logprobs are renormalized over the tokens it
kept, and so are the trainer's (`sampled_logprobs`, the sampling the gateway forces in
training). With truncation on, a second row per engine compares the same tokens with
the trainer's full softmax, to show what that accounts for.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from looprl import startup
from looprl.config import Config, EngineConfig
from looprl.engines.base import Engine
from looprl.engines.launch import start_engine
from looprl.rollout.trajectory import build_trajectories
from looprl.runs.paths import RunPaths
from looprl.scheduling.parts import build_trainer
from looprl.tasks import load_task
from looprl.training.batch import TrainBatch, build_batch
from looprl.training.losses import MISMATCH_RATIO_RANGE, mismatch_metrics
from looprl.training.trainer import Trainer
from looprl.types import Generation, Interaction, SamplingParams, Trajectory
from looprl.workflows.rlvr import chat_messages


@dataclass
class WorstToken:
    sample: int
    position: int  # index in the sample's completion
    token_id: int
    token: str
    engine_logprob: float
    trainer_logprob: float

    @property
    def abs_diff(self) -> float:
        return abs(self.engine_logprob - self.trainer_logprob)

    def row(self) -> dict[str, float | int | str]:
        return {
            "sample": self.sample,
            "position": self.position,
            "token": repr(self.token),
            "engine logprob": self.engine_logprob,
            "trainer logprob": self.trainer_logprob,
            "|diff|": self.abs_diff,
        }


@dataclass
class ConsistencyReport:
    engine: str
    samples: int
    tokens: int
    mean_abs_diff: float
    max_abs_diff: float
    kl: float
    ratio_outside_frac: float
    worst: list[WorstToken]

    def summary(self) -> dict[str, float | int | str]:
        low, high = MISMATCH_RATIO_RANGE
        return {
            "engine": self.engine,
            "samples": self.samples,
            "tokens": self.tokens,
            "mean |diff|": self.mean_abs_diff,
            "max |diff|": self.max_abs_diff,
            "KL(engine||trainer)": self.kl,
            f"ratio outside [{low:g}, {high:g}]": self.ratio_outside_frac,
        }


async def measure(
    engine: Engine,
    trainer: Trainer,
    tokenizer,
    prompts: list[list[int]],
    sampling: SamplingParams,
    *,
    name: str,
    worst: int = 5,
) -> ConsistencyReport:
    """Generate one completion per prompt with `engine` (concurrently), recompute its
    tokens' logprobs with `trainer`, and compare them."""
    generations, batch = await sample(engine, tokenizer, prompts, sampling)
    return compare(generations, batch, trainer.compute_logprobs(batch), tokenizer, name, worst)


async def sample(
    engine: Engine, tokenizer, prompts: list[list[int]], sampling: SamplingParams
) -> tuple[list[Generation], TrainBatch]:
    """One completion per prompt from `engine` (concurrently), and as a batch."""
    generations = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
    batch, _ = build_batch([_trajectory(g) for g in generations], "grpo", tokenizer.pad_token_id)
    return list(generations), batch


def compare(
    generations: list[Generation],
    batch: TrainBatch,
    trainer_logprobs: torch.Tensor,
    tokenizer,
    name: str,
    worst: int = 5,
) -> ConsistencyReport:
    """The report of `batch`'s engine logprobs against `trainer_logprobs` (N, T)."""
    mask = batch.loss_mask  # (N, T)
    figures = mismatch_metrics(trainer_logprobs, batch.behavior_logprobs, mask)
    engine_lp, trainer_lp = batch.behavior_logprobs[mask], trainer_logprobs[mask]  # (K,)
    diff = (engine_lp - trainer_lp).abs()
    rows, cols = mask.nonzero(as_tuple=True)  # row-major, as the masked values above
    worst_tokens = []
    for k in diff.argsort(descending=True)[:worst].tolist():
        row, col = int(rows[k]), int(cols[k])
        token_id = int(batch.input_ids[row, col])
        worst_tokens.append(
            WorstToken(
                sample=row,
                position=col - len(generations[row].prompt_ids),
                token_id=token_id,
                token=tokenizer.decode([token_id]),
                engine_logprob=float(engine_lp[k]),
                trainer_logprob=float(trainer_lp[k]),
            )
        )
    return ConsistencyReport(
        engine=name,
        samples=len(generations),
        tokens=int(mask.sum()),
        mean_abs_diff=figures["mismatch_logprob_abs_mean"],
        max_abs_diff=float(diff.max()),
        kl=figures["mismatch_kl_k3"],
        ratio_outside_frac=figures["mismatch_ratio_outside_frac"],
        worst=worst_tokens,
    )


async def check_consistency(
    cfg: Config, engine_types: list[str], *, samples: int, worst: int = 5
) -> list[ConsistencyReport]:
    """`measure` for each engine type in turn, on `samples` prompts of the task's train
    split, sampled as `cfg.sampling` says. The configured engine runs with its options;
    another type runs with its defaults and engine.dtype. With top_k / top_p set, each
    engine gets a second report, named "<engine>, trainer untruncated", of the same
    tokens against the trainer's full softmax. Engine files (server logs, weight
    folders) go to <run_dir>/consistency."""
    if samples < 1:
        raise ValueError(f"--samples={samples} must be >= 1")
    no_kl = cfg.train.model_copy(update={"kl_coef": 0.0})  # no reference model needed
    setups = {  # start-up for each engine type, before anything runs
        engine_type: startup.start(
            cfg.model_copy(update={"train": no_kl, "engine": _engine_config(cfg, engine_type)}),
            train=False,
        )
        for engine_type in engine_types
    }
    first = setups[engine_types[0]]
    torch.manual_seed(cfg.run.seed)
    tokenizer = first.model.tokenizer
    policy = first.model.load(cfg.model.dtype).to(first.device)
    trainer = build_trainer(first, policy)
    prompts = task_prompts(cfg, tokenizer, samples)
    sampling = SamplingParams(
        max_new_tokens=cfg.sampling.max_new_tokens,
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        top_k=cfg.sampling.top_k,
    )
    reports = []
    for engine_type, setup in setups.items():
        engine = await start_engine(setup, policy, RunPaths(setup.paths.root / "consistency"))
        try:
            generations, batch = await sample(engine, tokenizer, prompts, sampling)
        finally:
            await engine.stop()
        trainer_logprobs = trainer.compute_logprobs(batch)
        reports.append(compare(generations, batch, trainer_logprobs, tokenizer, engine_type, worst))
        if trainer.top_k or trainer.top_p < 1:
            full = _untruncated_logprobs(trainer, batch)
            name = f"{engine_type}, trainer untruncated"
            reports.append(compare(generations, batch, full, tokenizer, name, worst))
    return reports


def _engine_config(cfg: Config, engine_type: str) -> EngineConfig:
    """The configured engine section for its own type; another type's defaults, with
    engine.dtype."""
    if engine_type == cfg.engine.type:
        return cfg.engine
    return EngineConfig(type=engine_type, dtype=cfg.engine.dtype)


def _untruncated_logprobs(trainer: Trainer, batch: TrainBatch) -> torch.Tensor:
    """`trainer`'s logprobs of `batch` under its full softmax, without top_k / top_p."""
    truncation = trainer.top_k, trainer.top_p
    trainer.top_k, trainer.top_p = 0, 1.0
    try:
        return trainer.compute_logprobs(batch)
    finally:
        trainer.top_k, trainer.top_p = truncation


def task_prompts(cfg: Config, tokenizer, samples: int) -> list[list[int]]:
    """Chat-templated prompts of the first `samples` rows of the task's train split, as
    the built-in RLVR workflow sends them."""
    task = load_task(cfg.task)
    prompts = []
    for row in task.train[:samples]:
        messages = chat_messages(str(row[task.prompt_field]), task.system_prompt)
        prompts.append(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        )
    return prompts


def _trajectory(gen: Generation) -> Trajectory:
    """The generation as a training sample: prompt (masked out), then its sampled tokens."""
    interaction = Interaction.from_generation("consistency", gen)
    (trajectory,), _, _ = build_trajectories([interaction], 0.0, "per_call")
    return trajectory
