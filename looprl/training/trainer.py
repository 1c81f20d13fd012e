"""The trainer: a model, its AdamW optimizer and LR schedule, and one PPO-style update.

Owns: logprobs of a batch under the current weights (`compute_logprobs`), the update
(`train_step`), the weights handed to engines, and its own checkpointable state. It is
algorithm-blind: advantages arrive in the TrainBatch and the loss is losses.py's
objective (train.objective) with the configured aggregation and mismatch correction.
Logprobs are those of the distribution the engines sample from: softmax(logits /
temperature), restricted to the top_k / top_p set and renormalized when sampling
truncates (`sampled_logprobs`), so pi_prox/pi_behav compares like with like.

One `train_step`: recompute the proximal logprobs (and reference logprobs for the KL
penalty) without grad, then for each of `ppo_epochs` passes and each of `mini_batches`
mini-batches take one optimizer step, accumulating gradients over micro-batches whose
losses are normalized by the whole mini-batch (see losses.py), so the update does not
depend on `max_tokens_per_mb`. The LR schedule advances once per train_step, so
`warmup_steps` and `total_steps` count train_steps, not optimizer steps.

Where the time goes, and what is not computed. Every token through the decoder costs
the same, so the trainer runs as few as give the same gradient: a group's shared
prompt once, its rows packed after it without padding (shared_prefix.py; Llama-family
models), micro-batches made of whole groups; rows with zero advantage, which add
nothing to the gradient without a KL term, not at all; and the LM head only where a
sampled token is predicted.

Data parallelism (distributed.py) changes six hooks, here the one-process ones: how the
model is wrapped once built (`_distribute`), which rows of a (mini-)batch this process
runs and in how many forward passes (`_micro_batch_plan`), the sum over processes
(`_sum_over_ranks`), the gradient norm (`_clip_gradients`), and the gradients and the
adapter as full tensors (`full_gradients`, `_adapter_tensors`). Besides, it runs the
policy's forward passes under FSDP and keeps its state dicts unsharded.

With model.lora (training/lora.py) the model is wrapped by peft first: only the adapters
are parameters of the optimizer, travel to engines (`adapter_for_engine`) and go into
checkpoints; the frozen base, held in the compute dtype, is also the KL reference.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from dataclasses import fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from looprl.config import LoraConfig, TrainConfig
from looprl.diagnostics.oom import oom_phase
from looprl.memory import CPU_TOKENS_PER_MB
from looprl.models import DTYPES
from looprl.precision import TrainPrecision
from looprl.runtime import tune_malloc
from looprl.training import shared_prefix
from looprl.training.batch import (
    TrainBatch,
    micro_batch_indices,
    split_mini_batches,
)
from looprl.training.lora import (
    adapter_of,
    adapter_state,
    add_adapters,
    is_lora,
    load_adapter_state,
    reference_forward,
)
from looprl.training.losses import (
    aggregate,
    entropy_from_logits,
    kl_penalty,
    loss_normalizer,
    masked_mean,
    mismatch_metrics,
    policy_loss,
)
from looprl.types import LoraAdapter

log = logging.getLogger(__name__)

# Devices with torch's fused AdamW kernel: one pass over all parameters. Elsewhere torch
# loops over them in Python (on CPU, `foreach` is no faster): SmolLM2-135M's optimizer
# step took 0.40 s unfused, 0.09 s fused on 2 cores, ~20% of a small async RL step.
FUSED_ADAMW_DEVICES = frozenset({"cpu", "cuda", "xpu"})
_COUNTS = ("num_tokens", "num_micro_batches")  # summed over optimizer steps, not averaged


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr at train_step `step` (0-based): linear warmup reaching 1 at
    step warmup_steps - 1, then constant, or cosine / linear decay to 0 at total_steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    if cfg.lr_schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Logprob of input_ids[t] given input_ids[:t]; position 0 is 0. (B,T,V),(B,T) -> (B,T)."""
    logits = logits[:, :-1]  # (B, T-1, V), row t predicts token t + 1
    picked = logits.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    return F.pad(picked - logits.logsumexp(dim=-1), (1, 0))


def sampled_logprobs(
    logits: torch.Tensor, picked: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Logprob of each `picked` token (K,) under softmax(`logits` (K, V)), restricted to
    the top_k / top_p set and renormalized over it, as the engine sampled. (K,)

    Without truncation (top_k 0, top_p 1) the full softmax. The picked token always
    stays in the set: if the engine's logits kept it and these (another dtype) would
    not, its logprob is still that of a kept token.
    """
    if (top_k == 0 or top_k >= logits.shape[-1]) and top_p >= 1:
        return logits.gather(-1, picked[:, None]).squeeze(-1) - logits.logsumexp(-1)
    with torch.no_grad():
        keep = kept_tokens(logits, top_k=top_k, top_p=top_p)
        keep.scatter_(1, picked[:, None], True)
    kept = logits.masked_fill(~keep, -torch.inf)  # (K, V)
    return kept.gather(-1, picked[:, None]).squeeze(-1) - kept.logsumexp(-1)


def kept_tokens(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """The tokens sampling keeps (K, V) bool: the top_k largest logits (ties at the kth
    kept; 0: all), then the smallest most likely set whose mass reaches top_p (the most
    likely always kept), as the local engine and vLLM truncate. logits (K, V)."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (K, 1)
        keep = logits >= kth
    if top_p < 1:
        sorted_x, order = logits.masked_fill(~keep, -torch.inf).sort(dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # mass before it already reaches p
        drop[:, 0] = False
        keep &= ~torch.zeros_like(keep).scatter(1, order, drop)
    return keep


def _rows_with_gradient(batch: TrainBatch) -> torch.Tensor:
    """Rows (n,) whose advantage is not zero, or the shortest row when none is."""
    rows = (batch.advantages != 0).nonzero()[:, 0]
    return rows if len(rows) else batch.lengths.argmin().reshape(1)


class Trainer:
    """Trains `model` in place with `cfg`. `temperature`, `top_k` and `top_p` must be the
    engines' sampling ones, since logprobs are those of softmax(logits / temperature)
    truncated to the top_k / top_p set and renormalized (`sampled_logprobs`). `ref_model`,
    a separate copy for the KL penalty, is put in eval mode and frozen. `precision` is
    what start-up decided (looprl/startup.py); without it, an explicit
    `cfg.compute_dtype` (float32, or bfloat16 autocast over float32 weights) is taken as
    it is, and `auto` is refused: nothing below start-up decides it. `max_tokens_per_mb`
    is start-up's memory plan (looprl/memory.py); without it, the config's, or on its
    None `CPU_TOKENS_PER_MB`."""

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        ref_model: nn.Module | None = None,
        lora: LoraConfig | None = None,
        teacher_model: nn.Module | None = None,
        precision: TrainPrecision | None = None,
        max_tokens_per_mb: int | None = None,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0 for training logprobs")
        if top_k < 0 or not 0 < top_p <= 1:
            raise ValueError(f"top_k={top_k} must be >= 0 and top_p={top_p} in (0, 1]")
        self.top_k, self.top_p = top_k, top_p
        lora = lora if lora is not None and lora.enabled else None
        if cfg.kl_coef > 0 and ref_model is None and lora is None:
            raise ValueError(
                f"train.kl_coef={cfg.kl_coef} needs a reference model; pass "
                "ref_model or set train.kl_coef=0"
            )
        if ref_model is model:
            raise ValueError("ref_model is the policy model itself; pass a frozen copy")
        if (cfg.algorithm == "distill") != (teacher_model is not None):
            raise ValueError(
                f"train.algorithm={cfg.algorithm} needs a teacher model exactly when it is "
                "distill; pass teacher_model (train.teacher_path) with distill only"
            )
        if ref_model is not None and lora is not None:
            raise ValueError(
                "with model.lora the reference is the frozen base itself; pass no ref_model"
            )
        tune_malloc()
        self.cfg = cfg
        self.temperature = temperature
        self.ref_model = None if ref_model is None else ref_model.eval().requires_grad_(False)
        self.teacher = None if teacher_model is None else teacher_model.eval().requires_grad_(False)
        self.device = next(model.parameters()).device
        master_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.precision = precision or TrainPrecision.as_set(cfg.compute_dtype, master_dtype)
        # Tokens per micro-batch: start-up's memory plan, else the config's, else the CPU's.
        self.max_tokens_per_mb = max_tokens_per_mb or cfg.max_tokens_per_mb or CPU_TOKENS_PER_MB
        if cfg.activation_checkpointing:
            # Non-reentrant: it needs no input that requires grad, as LoRA's frozen
            # embeddings are not; the decoder layers recompute in backward (train mode).
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(kwargs)
            else:  # transformers before the rename (5.17, on the GPU machines we know)
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if lora is not None:
            # The frozen base needs no float32 master copy: it is held in the dtype the
            # forward computes in; only the adapters train, in float32.
            model = add_adapters(model, lora, DTYPES[self.precision.dtype])
        self.model = model = self._distribute(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            fused=self.device.type in FUSED_ADAMW_DEVICES,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, cfg)
        )
        self.version = 0
        # The last train_step's logprobs of its batch at the weights it started from,
        # (N, T) float32, NaN where it ran no token (see train_step).
        self.step_logprobs: torch.Tensor | None = None
        self._recording: tuple[torch.Tensor, torch.Tensor] | None = None  # see train_step
        self._distill_baseline = 0.0  # see train_step
        self._entropy_coef = 0.0  # this step's entropy bonus (train.entropy_floor), see train_step
        self._turn_entropy: torch.Tensor | None = None  # see train_step

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Float32 logprobs (N, T) of `batch` under the current weights, without grad."""
        with oom_phase("logprob recomputation", self._memory_settings):
            return self._logprobs_without_grad(self.model, batch)

    def _memory_settings(self) -> dict[str, object]:
        return {
            "train.max_tokens_per_mb": self.max_tokens_per_mb,
            "train.compute_dtype": self.precision.dtype,
        }

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Update the weights on `batch`. Returns stats averaged over optimizer steps, plus
        the lr used, the step's wall time and train tokens/s over it (forward + backward),
        micro-batch and optimizer-step counts, and the new version."""
        start = time.perf_counter()
        self.model.train()
        ref = self._reference_logprobs(batch)
        # With one optimizer step per batch the proximal policy is the policy of that very
        # forward pass, so its logprobs come from it (detached): one forward pass saved.
        single_update = self.cfg.ppo_epochs * self.cfg.mini_batches == 1
        proximal = None if single_update else self.compute_logprobs(batch)
        # The trajectory files' trainer logprobs: the proximal ones, or under a single
        # update the training forward's own, which `accumulate_gradients` records (NaN
        # where it ran no token: rows with zero advantage).
        self.step_logprobs = proximal
        self._recording = (
            (torch.zeros(batch.input_ids.shape), torch.zeros(batch.input_ids.shape))
            if single_update
            else None
        )
        teacher = None if self.teacher is None else self._logprobs_without_grad(self.teacher, batch)
        if teacher is not None:
            # Distillation's baseline: the batch's mean of log pi_teacher - log pi_behav
            # over its sampled tokens, a constant subtracted from every token's advantage
            # (unbiased, like GRPO's group mean): the raw advantages are all near
            # -KL, tens of nats per token from a sharp teacher, and their common part
            # only adds variance.
            gap = (teacher - batch.behavior_logprobs)[batch.loss_mask]
            self._distill_baseline = float(gap.mean()) if len(gap) else 0.0
        batch = replace(
            batch, proximal_logprobs=proximal, ref_logprobs=ref, teacher_logprobs=teacher
        )
        # The entropy bonus of this step: on when train.entropy_floor is 0, or when the
        # engine's sampled tokens, mean -log pi an estimate of the policy's entropy,
        # fall below it.
        sampled_nll = -float(batch.behavior_logprobs[batch.loss_mask].mean())
        floor = self.cfg.entropy_floor
        self._entropy_coef = self.cfg.entropy_coef if floor == 0 or sampled_nll < floor else 0.0
        # Per-turn entropy sums and token counts (turns 0..max), filled by the passes.
        turns = int(batch.token_turns.max())
        self._turn_entropy = torch.zeros(turns + 1, 2, dtype=torch.float64) if turns > 1 else None
        steps: list[dict[str, float]] = []
        for _ in range(self.cfg.ppo_epochs):
            for mini in split_mini_batches(batch, self.cfg.mini_batches):
                self.optimizer.zero_grad(set_to_none=True)
                with oom_phase("training", self._memory_settings):
                    stats = self.accumulate_gradients(mini)
                stats["grad_norm"] = self._clip_gradients()
                self.optimizer.step()
                steps.append(stats)
        self.optimizer.zero_grad(set_to_none=True)
        if self._recording is not None:
            values, filled = self._sum_over_ranks(torch.stack(self._recording)).unbind()
            self.step_logprobs = torch.where(filled > 0, values, torch.nan)
            self._recording = None
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.version += 1
        counts = {key: sum(s.pop(key) for s in steps) for key in _COUNTS}
        out = {key: sum(s[key] for s in steps) / len(steps) for key in steps[0]}
        elapsed = time.perf_counter() - start
        if self._turn_entropy is not None:  # each process ran its own rows
            summed = self._sum_over_ranks(self._turn_entropy)
            for k, (total, tokens) in enumerate(summed.tolist()):
                if tokens > 0:
                    out[f"turn{k}_entropy"] = total / tokens
            self._turn_entropy = None
        out.update(
            sampled_nll=sampled_nll,
            entropy_bonus_coef=self._entropy_coef,
            lr=lr,
            tokens_per_s=counts["num_tokens"] / elapsed,
            train_time_s=elapsed,
            num_micro_batches=counts["num_micro_batches"],
            optimizer_steps=float(len(steps)),
            version=float(self.version),
        )
        return out

    def accumulate_gradients(self, batch: TrainBatch) -> dict[str, float]:
        """Add the gradient of `batch`'s whole loss into `.grad`, one micro-batch at a time.

        `batch.proximal_logprobs` None means the weights have not moved since the batch was
        given (one optimizer step per batch): the proximal logprobs are then this forward's,
        detached. `batch.ref_logprobs`, when filled, adds kl_coef x KL. Returns the loss,
        stats weighted by sampled tokens, the engine-vs-trainer mismatch metrics
        (losses.mismatch_metrics: behavior vs proximal logprobs) over the tokens sampled by
        the weights this trainer holds (`versions == self.version`; that share of the
        sampled tokens is `mismatch_tokens_frac`, and the figures are 0 when it is 0), and
        the counts `num_tokens` (non-pad tokens through forward + backward) and
        `num_micro_batches`, all over every process.

        Rows whose advantage is zero (a GRPO group whose rewards are all equal) add exactly
        nothing to the clipped loss's gradient, so without a KL term they are left out of
        the forward; the loss is still normalized over every row, and the stats cover the
        rows trained on. (If none is left, the shortest row runs: every parameter then gets
        a zero gradient, as the whole batch would give it, for the optimizer's step.)
        """
        cfg = self.cfg
        by_turn = cfg.loss_agg == "turn_token_mean"  # its normalizer reads the call positions
        positions = batch.token_turns if by_turn else None
        normalizer = loss_normalizer(batch.loss_mask, cfg.loss_agg, positions)
        kept = torch.arange(batch.num_sequences)  # rows of `batch` run, by their index
        if cfg.kl_coef == 0 and batch.teacher_logprobs is None and self._entropy_coef == 0:
            kept = _rows_with_gradient(batch)
            batch = batch.select(kept)
        eps_clip, eps_clip_high = cfg.clip_range()
        weighted: dict[str, float] = defaultdict(float)  # stats x sampled tokens
        by_fresh: dict[str, float] = defaultdict(float)  # mismatch metrics x fresh tokens
        total_loss, num_micro_batches, fresh_tokens = 0.0, 0, 0
        for rows, counts in self._micro_batch_plan(batch):
            mb = self._to_device(batch.select(rows))
            turns = mb.token_turns if by_turn or self._turn_entropy is not None else None
            positions = turns if by_turn else None
            logits = self._sampled_logits(self.model, mb)  # (K, V), K = sampled tokens
            picked = mb.input_ids[mb.loss_mask]  # (K,)
            sampled = sampled_logprobs(logits, picked, top_k=self.top_k, top_p=self.top_p)
            # (B, T), zero off the mask; masked_scatter fills in the same row-major order
            logprobs = torch.zeros(
                mb.input_ids.shape, dtype=sampled.dtype, device=sampled.device
            ).masked_scatter(mb.loss_mask, sampled)
            proximal = logprobs.detach() if mb.proximal_logprobs is None else mb.proximal_logprobs
            if self._recording is not None and counts:
                values, filled = self._recording
                width = mb.input_ids.shape[1]
                values[kept[rows], :width] += proximal.float().cpu()
                filled[kept[rows], :width] += mb.loss_mask.cpu().float()
            advantages = mb.advantages  # (B,)
            if mb.teacher_logprobs is not None:  # distillation: -reverse KL per token (B, T)
                gap = torch.where(mb.loss_mask, mb.teacher_logprobs - proximal, 0.0)
                advantages = torch.where(mb.loss_mask, gap - self._distill_baseline, 0.0)
            loss, stats = policy_loss(
                logprobs,
                proximal,
                advantages,
                mb.loss_mask,
                eps_clip=eps_clip,
                eps_clip_high=eps_clip_high,
                agg=cfg.loss_agg,
                normalizer=normalizer,
                objective=cfg.objective,
                behavior_logprobs=mb.behavior_logprobs,
                mismatch_correction=cfg.mismatch_correction,
                mismatch_cap=cfg.mismatch_cap,
                mismatch_floor=cfg.mismatch_floor,
                mismatch_level=cfg.mismatch_level,
                positions=positions,
            )
            with torch.set_grad_enabled(self._entropy_coef > 0):
                token_entropy = entropy_from_logits(logits)  # (K,)
            if self._entropy_coef > 0:  # the bonus, aggregated as the loss is
                per_token = torch.zeros_like(logprobs).masked_scatter(mb.loss_mask, token_entropy)
                bonus = aggregate(per_token, mb.loss_mask, cfg.loss_agg, normalizer, positions)
                loss = loss - self._entropy_coef * bonus
            token_entropy = token_entropy.detach()
            if self._turn_entropy is not None and counts:  # per turn: entropy sum, tokens
                pairs = torch.stack([token_entropy, torch.ones_like(token_entropy)], dim=1)
                self._turn_entropy.index_add_(0, turns[mb.loss_mask].cpu(), pairs.double().cpu())
            with torch.no_grad():
                # A micro-batch of rows left out of the loss has no sampled token.
                stats["entropy"] = float(token_entropy.sum()) / max(len(picked), 1)
                stats["logprob_mean"] = masked_mean(logprobs.detach(), mb.loss_mask)
                if mb.teacher_logprobs is not None:  # k1 estimate of KL(student || teacher)
                    stats["distill_kl"] = -masked_mean(gap, mb.loss_mask)
            if mb.ref_logprobs is not None:
                kl = kl_penalty(logprobs, mb.ref_logprobs, cfg.kl_estimator)  # (B, T)
                kl_loss = aggregate(kl, mb.loss_mask, cfg.loss_agg, normalizer, positions)
                loss = loss + cfg.kl_coef * kl_loss
                stats["kl"] = masked_mean(kl.detach(), mb.loss_mask)
            del logits  # so two micro-batches' (B, T, V) logits are never alive at once
            if counts:
                loss.backward()
                total_loss += loss.item()
                num_micro_batches += 1
            else:  # a pass that only keeps data-parallel ranks in step: zero gradient
                loss.mul(0.0).backward()
            # Engine vs trainer on tokens sampled by the weights the trainer holds: the
            # same weights, so what differs is numerics (dtype, kernels), not staleness.
            fresh = mb.loss_mask & (mb.versions == self.version)
            n_fresh = int(fresh.sum()) if counts else 0
            fresh_tokens += n_fresh
            for key, value in mismatch_metrics(proximal, mb.behavior_logprobs, fresh).items():
                by_fresh[key] += value * n_fresh
            for key, value in stats.items():
                weighted[key] += (value * mb.num_sampled_tokens) if counts else 0.0
        # One sum over processes for every stat (insertion order: the same code ran on each).
        keys, fresh_keys = list(weighted), list(by_fresh)
        local = [weighted[key] for key in keys] + [by_fresh[key] for key in fresh_keys]
        local += [float(fresh_tokens), total_loss, float(num_micro_batches)]
        *sums, fresh_tokens, total_loss, num_micro_batches = self._sum_over_ranks(
            torch.tensor(local, dtype=torch.float64)
        ).tolist()
        sampled_tokens = max(batch.num_sampled_tokens, 1)
        stat_sums, fresh_sums = sums[: len(keys)], sums[len(keys) :]
        out = {key: value / sampled_tokens for key, value in zip(keys, stat_sums, strict=True)}
        out.update(
            {key: v / max(fresh_tokens, 1) for key, v in zip(fresh_keys, fresh_sums, strict=True)}
        )
        out.update(
            mismatch_tokens_frac=fresh_tokens / sampled_tokens,
            loss=total_loss,
            num_tokens=float(batch.num_tokens),
            num_micro_batches=num_micro_batches,
        )
        return out

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The accumulated gradients by parameter name, detached copies on the CPU (for tests
        and diagnostics, e.g. after `accumulate_gradients`)."""
        return {
            name: p.grad.detach().cpu().clone()
            for name, p in self.model.named_parameters()
            if p.grad is not None
        }

    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        """The current weights, detached. They share storage with the live parameters, so
        an engine must copy them (load_state_dict does) before the next train_step."""
        return self.model.state_dict()

    def adapter_for_engine(self) -> LoraAdapter | None:
        """With model.lora, the current adapter (detached, sharing storage with the live
        parameters: an engine copies it); None when every weight trains."""
        return adapter_of(self.model, self._adapter_tensors()) if is_lora(self.model) else None

    def state_dict(self) -> dict[str, Any]:
        """Model (with model.lora: the adapter only, the base is model.path's), optimizer,
        schedule and version."""
        lora = is_lora(self.model)
        return {
            "model": self._adapter_tensors() if lora else self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if is_lora(self.model):
            load_adapter_state(self.model, state["model"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]

    def _distribute(self, model: nn.Module) -> nn.Module:
        """The model as this process trains it; one process keeps it as it is."""
        return model

    def _adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's parameters by name, as full tensors."""
        return adapter_state(self.model)

    def _reference_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """Logprobs (N, T) under the KL reference: the frozen copy, or with model.lora the
        base with its adapters off; None without a KL term."""
        if self.cfg.kl_coef == 0:
            return None
        if self.ref_model is not None:
            return self._logprobs_without_grad(self.ref_model, batch)
        with reference_forward(self.model):
            return self._logprobs_without_grad(self.model, batch)

    @torch.no_grad()
    def _logprobs_without_grad(self, model: nn.Module, batch: TrainBatch) -> torch.Tensor:
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)  # (N, T)
        for rows, counts in self._micro_batch_plan(batch):
            mb = self._to_device(batch.select(rows))
            logits = self._logits(model, mb)  # (n, t, V)
            logprobs = token_logprobs(logits, mb.input_ids)  # (n, t)
            if self.top_k or self.top_p < 1:  # the sampled tokens' under the truncation
                at = mb.loss_mask[:, 1:]  # row t predicts token t + 1
                logprobs[:, 1:][at] = sampled_logprobs(
                    logits[:, :-1][at], mb.input_ids[:, 1:][at], top_k=self.top_k, top_p=self.top_p
                )
            del logits
            if counts:
                out[rows, : logprobs.shape[1]] = logprobs.cpu()
        return self._sum_over_ranks(out)  # each row was computed by one process

    def _micro_batch_plan(self, batch: TrainBatch) -> list[tuple[torch.Tensor, bool]]:
        """This process's forward passes over `batch`: the rows (n_i,) of each micro-batch
        and whether it counts. Here every row; a data-parallel rank takes its share and
        pads with passes that do not count (see distributed.py)."""
        return [
            (rows, True) for rows in self._micro_batches(batch, torch.arange(len(batch.lengths)))
        ]

    def _micro_batches(self, batch: TrainBatch, rows: torch.Tensor) -> list[torch.Tensor]:
        """`rows` (n,) of `batch` in micro-batches under train.max_tokens_per_mb: packed
        with their group's shared prompt where the model allows it (shared_prefix.py),
        else right-padded, first-fit-decreasing by length."""
        budget = self.max_tokens_per_mb
        if shared_prefix.supports(self.model):
            plan = shared_prefix.micro_batches(
                batch.input_ids[rows], batch.lengths[rows], batch.group_index[rows], budget
            )
        else:
            plan = micro_batch_indices(batch.lengths[rows], budget)
        return [rows[part] for part in plan]

    def _sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over data-parallel processes; one process has nothing to add."""
        return values

    def _clip_gradients(self) -> float:
        """Clip the gradients to cfg.max_grad_norm; returns their norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))

    def _sampled_logits(self, model: nn.Module, mb: TrainBatch) -> torch.Tensor:
        """Float32 logits / temperature (K, V) only at the K positions that predict a
        sampled token (row t predicts token t + 1), in row-major order of `loss_mask`.

        The LM head and every vocabulary-wide op skip the prompt and tool tokens, about
        half of an RL batch. Assumes the logits are the output embedding of the decoder's
        last hidden state, as in Llama, Qwen and Mistral.
        """
        with self._autocast():
            hidden = self._hidden(model, mb)  # (B, T, H)
            logits = model.get_output_embeddings()(hidden[:, :-1][mb.loss_mask[:, 1:]])
        return logits.float().div_(self.temperature)

    def _logits(self, model: nn.Module, mb: TrainBatch) -> torch.Tensor:
        """Float32 logits / temperature (B, T, V), under bf16 autocast when chosen."""
        with self._autocast():
            logits = model.get_output_embeddings()(self._hidden(model, mb))
        # In place: at 8192 tokens x 49152 vocab a copy would cost another 1.6 GB.
        return logits.float().div_(self.temperature)

    def _hidden(self, model: nn.Module, mb: TrainBatch) -> torch.Tensor:
        """The decoder's last hidden states (B, T, H); the prompt a group's rows share is
        computed once for them where the model allows it (shared_prefix.py)."""
        decoder = model.get_decoder()
        packing = None
        if shared_prefix.supports(model):
            packing = shared_prefix.pack(mb.input_ids, mb.lengths, mb.group_index)
        if packing is None:
            return decoder(
                input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False
            ).last_hidden_state
        return shared_prefix.hidden_states(decoder, packing, model.config.hidden_size)

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, torch.bfloat16, enabled=self.precision.autocast)

    def _to_device(self, mb: TrainBatch) -> TrainBatch:
        values = {f.name: getattr(mb, f.name) for f in fields(mb)}
        return TrainBatch(**{k: v if v is None else v.to(self.device) for k, v in values.items()})
