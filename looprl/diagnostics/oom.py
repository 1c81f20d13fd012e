"""Out of memory, by phase: an out-of-memory error re-raised with the phase it happened
in (engine load, generation, logprob recomputation, training), the current settings and
the ones that lower memory there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

OOM_ADVICE = {
    "engine load": "load the model in bfloat16 (engine.dtype=bfloat16) or use a smaller model",
    "generation": "lower engine.max_tokens_per_batch (the KV budget), engine.max_batch_size "
    "or rollout.max_concurrent_rollouts; on a GPU shared with the trainer, set "
    "engine.memory_fraction to the share the engine may take",
    "logprob recomputation": "lower train.max_tokens_per_mb (tokens per forward pass)",
    "training": "lower train.max_tokens_per_mb (tokens per micro-batch; gradients add up "
    "the same), set train.compute_dtype=bfloat16 where the device has bf16, set "
    "train.activation_checkpointing=true, lower engine.memory_fraction where the engine "
    "shares the GPU, or split the data-parallel work over more ranks",
}


class PhaseOutOfMemory(RuntimeError):
    """Out of memory, with the phase it happened in and the settings that reduce it."""


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


@contextmanager
def oom_phase(
    phase: str, settings: Callable[[], dict[str, object]] | None = None
) -> Iterator[None]:
    """Re-raise an out-of-memory error inside the block as PhaseOutOfMemory naming
    `phase`, the current settings (`settings()`, called only then: the engine enters
    this on every decode step) and what lowers memory there."""
    try:
        yield
    except Exception as e:
        if not is_out_of_memory(e) or isinstance(e, PhaseOutOfMemory):
            raise
        now = ", ".join(f"{k}={v}" for k, v in (settings() if settings else {}).items())
        raise PhaseOutOfMemory(
            f"Out of memory during {phase}" + (f" ({now})" if now else "") + f": {e}\n"
            f"To use less memory in {phase}: {OOM_ADVICE[phase]}."
        ) from e
