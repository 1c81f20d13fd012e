"""Data-parallel training: the Trainer of one rank, its model sharded by FSDP2.

Owns `DataParallelTrainer`, built in each trainer rank once torch.distributed is
initialized (gloo on CPU, NCCL with a GPU per rank; the Ray scheduler's `TrainerRank`
actors, joined by scheduling/ranks.py's `join_group`), and `balanced_shards`, which rows
of a mini-batch each rank trains. Does not own starting ranks nor giving them their
batch (scheduling/ray.py).

Every rank is given the SAME full TrainBatch. Each mini-batch's rows are split into
token-balanced shards that every rank computes alike, and a rank runs forward and
backward on its own shard only. A micro-batch's loss is normalized by the WHOLE
mini-batch (losses.py), which every rank holds, so the ranks' gradients SUM to the
one-process gradient: FSDP's gradient reduction is told to divide by 1, not by the number
of ranks. Proximal and reference logprobs are computed the same way, each row by one rank,
and summed over ranks.

FSDP2 (`fully_shard`) shards each decoder layer, plus a root unit for the rest
(embeddings, final norm, LM head, so tied embeddings stay one parameter). Its all-gathers
and reduce-scatters run inside every forward and backward, so every rank must run the
same number of them: a rank with fewer micro-batches than another, or no rows at all,
pads with placeholder passes over the mini-batch's shortest row, whose loss is multiplied
by 0 (training) or whose logprobs are dropped (recomputation). The reference model is not
sharded: a full frozen copy per rank, which needs no lockstep. Stats are summed over ranks,
so `train_step` returns the same global stats on every rank.

With one rank nothing is sharded and training is exactly the Trainer's; the state dicts
keep the format of any rank count (parameter names, full tensors), so a checkpoint saved
by N ranks loads into M.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from looprl.config import LoraConfig, TrainConfig
from looprl.precision import TrainPrecision
from looprl.training.batch import TrainBatch
from looprl.training.lora import check_adapter_state, is_lora
from looprl.training.trainer import Trainer

log = logging.getLogger(__name__)

_FULL_ON_RANK_0 = StateDictOptions(full_state_dict=True, cpu_offload=True)  # others get {}
_FULL = StateDictOptions(full_state_dict=True)  # every rank loads the same full state


def balanced_shards(lengths: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Rows of a batch with `lengths` (N,) in `world_size` shards of near-equal token
    counts: longest row first (ties in index order), each to the shard with the fewest
    tokens so far (ties: the lowest rank). Each shard (n_r,) int64 lists its rows in index
    order; with N < world_size some are empty. Deterministic: every rank computes all."""
    totals = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: -int(lengths[i])):
        rank = min(range(world_size), key=totals.__getitem__)
        shards[rank].append(i)
        totals[rank] += int(lengths[i])
    return [torch.tensor(sorted(rows), dtype=torch.int64) for rows in shards]


class DataParallelTrainer(Trainer):
    """The Trainer of this rank. Build it on every rank after init_process_group, from
    the same weights on this rank's device. From then on every method that touches the
    model is collective: call it on every rank, with the same arguments (train_step,
    accumulate_gradients, compute_logprobs, full_gradients, the state dicts). With more
    than one rank the model's parameters are shards: call it only through the trainer."""

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
        if not dist.is_initialized():
            raise RuntimeError(
                "DataParallelTrainer needs torch.distributed initialized: build it in a "
                "trainer rank (scheduler.type=ray starts them), or use Trainer in one process"
            )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._root: _Root | None = None
        super().__init__(
            model,
            cfg,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            ref_model=ref_model,
            lora=lora,
            teacher_model=teacher_model,
            precision=precision,
            max_tokens_per_mb=max_tokens_per_mb,
        )

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Trainer.train_step on this rank's shards of `batch`, the same on every rank."""
        self._check_same_batch(batch)
        smallest = batch.num_sequences // self.cfg.mini_batches
        if self.rank == 0 and smallest < self.world_size:
            log.warning(
                "A mini-batch of %d sequences (%d in the batch, train.mini_batches=%d) leaves "
                "%d of %d ranks without rows; they only run placeholder passes. Use fewer "
                "mini-batches or ranks, or a larger batch.",
                smallest,
                batch.num_sequences,
                self.cfg.mini_batches,
                self.world_size - smallest,
                self.world_size,
            )
        return super().train_step(batch)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The accumulated gradients by parameter name, unsharded, on the CPU of every rank."""
        if self._root is None:
            return super().full_gradients()
        return {
            name: p.grad.full_tensor().cpu()
            for name, p in self.model.named_parameters()
            if p.grad is not None
        }

    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        """The full weights as CPU tensors on rank 0; {} on the other ranks."""
        return get_model_state_dict(self.model, options=_FULL_ON_RANK_0)

    def state_dict(self) -> dict[str, Any]:
        """Full model and optimizer state (CPU tensors, by parameter name) on rank 0, {} for
        both on the other ranks (with model.lora the model is the adapter, on every rank);
        scheduler and version on every rank."""
        lora = is_lora(self.model)
        return {
            "model": self._adapter_tensors()
            if lora
            else get_model_state_dict(self.model, options=_FULL_ON_RANK_0),
            "optimizer": get_optimizer_state_dict(
                self.model, self.optimizer, options=_FULL_ON_RANK_0
            ),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load rank 0's `state_dict()` (of any number of ranks), given to every rank."""
        if is_lora(self.model):
            check_adapter_state(self.model, state["model"])
        options = replace(_FULL, strict=not is_lora(self.model))  # the base is not saved
        # A copy: without strict, set_model_state_dict fills the dict it is given with the
        # keys it lacks (the frozen base's).
        set_model_state_dict(self.model, dict(state["model"]), options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=_FULL)
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]

    def _distribute(self, model: nn.Module) -> nn.Module:
        """Shard `model` over the ranks (before the optimizer is built on its shards)."""
        self._root = _shard(model) if self.world_size > 1 else None
        return model

    def _adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's full tensors on every rank (a collective: each rank gathers)."""
        return {
            name: t.full_tensor().cpu() if isinstance(t, DTensor) else t.cpu()
            for name, t in super()._adapter_tensors().items()
        }

    def _micro_batch_plan(self, batch: TrainBatch) -> list[tuple[torch.Tensor, bool]]:
        """This rank's shard in micro-batches, then placeholder passes up to the most
        micro-batches of any rank (every rank computes every rank's plan)."""
        lengths = batch.lengths
        plans = [
            self._micro_batches(batch, shard) for shard in balanced_shards(lengths, self.world_size)
        ]
        mine = plans[self.rank]
        placeholder = lengths.argmin().reshape(1)  # the cheapest pass
        padding = max(map(len, plans)) - len(mine)
        return [(rows, True) for rows in mine] + [(placeholder, False)] * padding

    def _sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        summed = values.to(self.device)  # NCCL reduces GPU tensors only
        dist.all_reduce(summed)
        return summed.to(values.device)

    def _clip_gradients(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        # Sharded, the norm is a DTensor; full_tensor() is the norm over every shard.
        return float(norm if self._root is None else norm.full_tensor())

    def _sampled_logits(self, model: nn.Module, mb: TrainBatch) -> torch.Tensor:
        return self._policy_forward(super()._sampled_logits, model, mb)

    def _logits(self, model: nn.Module, mb: TrainBatch) -> torch.Tensor:
        return self._policy_forward(super()._logits, model, mb)

    def _policy_forward(
        self,
        logits_fn: Callable[[nn.Module, TrainBatch], torch.Tensor],
        model: nn.Module,
        mb: TrainBatch,
    ) -> torch.Tensor:
        """`logits_fn(model, mb)`, run as the FSDP root's forward when `model` is the
        sharded policy (the reference model is not sharded)."""
        if self._root is None or model is not self.model:
            return logits_fn(model, mb)
        return self._root(logits_fn, mb)

    def _check_same_batch(self, batch: TrainBatch) -> None:
        """Raise on every rank if the ranks were given different batches: they would plan
        different passes and deadlock, or sum gradients of different losses."""
        if self.world_size == 1:
            return
        fingerprint = torch.tensor(
            [
                batch.num_sequences,
                batch.input_ids.shape[1],
                batch.num_tokens,
                batch.num_sampled_tokens,
                int(batch.input_ids.sum()),
            ],
            device=self.device,
        )
        gathered = [torch.empty_like(fingerprint) for _ in range(self.world_size)]
        dist.all_gather(gathered, fingerprint)
        if any(not torch.equal(g, gathered[0]) for g in gathered):
            seen = "; ".join(f"rank {r}: {g.tolist()}" for r, g in enumerate(gathered))
            raise ValueError(
                "DataParallelTrainer.train_step got different batches on different ranks "
                f"(sequences, width, tokens, sampled tokens, sum of input_ids: {seen}); "
                "give every rank the same full TrainBatch"
            )


class _Root(nn.Module):
    """The FSDP root. FSDP all-gathers the root unit (embeddings, final norm, LM head) only
    around its module's forward, and the trainer calls the decoder and the LM head apart
    (`Trainer._sampled_logits`), so every policy forward runs as this module's forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, logits_fn: Callable[[nn.Module, TrainBatch], torch.Tensor], mb: TrainBatch
    ) -> torch.Tensor:
        return logits_fn(self.model, mb)


def _shard(model: nn.Module) -> _Root:
    """Shard `model` in place over the default process group: one FSDP unit per decoder
    layer, one root unit for the rest. Gradients are summed over ranks, not averaged."""
    root = _Root(model)
    for layer in model.get_decoder().layers:
        fully_shard(layer)
    fully_shard(root)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # SUM collectives only (gloo has no PREMUL_SUM); dividing by 1 is skipped.
            module.set_force_sum_reduction_for_comms(True)
    return root
