"""The memory plan of one device: how many tokens a training micro-batch takes and how
many tokens of K/V the local engine may hold, when both share a GPU.

Why it exists. On a CPU the defaults hold (train.max_tokens_per_mb 4096, the engine's
max_tokens_per_batch 65536): host memory is large next to a small model, and the
user sets them. A GPU is a fixed pool the trainer and the engine share in one process
(collocated): a micro-batch budget that fits an 8 GB card wastes an 80 GB one, and an
engine that takes every free byte for K/V leaves the trainer nothing. So on a GPU:

1. At start-up (`plan`), before anything is loaded, from the device's free memory and the
   model's sizes (`ModelSizes`, counted on the meta device: no weights read):
   - what stays for the whole run: the trainer's master weights, gradients and AdamW
     state (with LoRA: the frozen base in the compute dtype), bf16 copies autocast
     makes, a KL reference or distillation teacher, the engine's weights (its model
     copy and its fused weights);
   - the trainer's micro-batch, unless train.max_tokens_per_mb is set: `TRAIN_SHARE` of
     what is left (all of it but the headroom when the engine is not on this device),
     over the activation bytes one token needs (`ModelSizes.train_bytes_per_token`, an
     upper estimate: every layer's saved activations, attention probabilities at the
     longest sequence, float32 logits and their gradient), at most `MAX_TOKENS_PER_MB`;
   - the engine's K/V: engine.memory_fraction x the device's memory, less its weights,
     when set; else what the trainer's plan leaves; at most engine.max_tokens_per_batch.
2. After the first train step (`kv_tokens_after_step`), when engine.memory_fraction is
   not set: the step's measured peak replaces the estimate, and the engine's K/V budget
   becomes what that peak leaves (engine.set_kv_budget), so the estimate's slack goes
   to the engine.

Everything here is arithmetic on numbers passed in; start-up reads the device's memory
(`device_memory`) and the single-process scheduler reads the peak. The numbers and the
decision are logged in plain words.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

CPU_TOKENS_PER_MB = 4096  # train.max_tokens_per_mb unset, on a CPU (and outside a run)
TRAIN_SHARE = 0.5  # of the memory left after the fixed costs, when the engine shares it
HEADROOM = 0.9  # of the device's memory the plan hands out (fragmentation, CUDA context)
MAX_TOKENS_PER_MB = 32768
MIN_TOKENS = 256
_GIB = 2**30
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelSizes:
    """What one model costs in memory, per parameter set and per token."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config) -> ModelSizes:
        """Counted from a Hugging Face config by building the model on the meta device
        (no memory, no weights read); the shapes from the config's text part."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        text = config.get_text_config()
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(
            params=params,
            layers=text.num_hidden_layers,
            hidden=text.hidden_size,
            intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
            heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab=text.vocab_size,
        )

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V of one token over every layer, in the engine's dtype."""
        return 2 * self.layers * self.kv_heads * self.head_dim * _BYTES[dtype]

    def train_bytes_per_token(self, compute: str, checkpointing: bool) -> int:
        """Activation bytes one token of a micro-batch needs through forward and backward
        (an upper estimate). Per layer, kept for backward: the norms' inputs and outputs,
        q|k|v, the attention output, the MLP's gate, up and product: about 8 x hidden +
        4 x intermediate values (scaled_dot_product_attention's fused kernels keep no
        attention probabilities); with activation checkpointing only each layer's input
        is kept and one layer is recomputed at a time. Then the float32 logits, their
        gradient and the compute-dtype logits."""
        c = _BYTES[compute]
        layer = (8 * self.hidden + 4 * self.intermediate) * c
        layers = self.hidden * c * self.layers + layer if checkpointing else layer * self.layers
        return layers + self.vocab * (4 + 4 + c)


@dataclass(frozen=True)
class MemoryPlan:
    """The decided budgets: tokens per training micro-batch and engine K/V tokens.
    `replan`: resize the engine's K/V from the first train step's measured peak, on a
    device of `device_bytes` where one token's K/V takes `kv_bytes_per_token`."""

    train_tokens_per_mb: int
    engine_kv_tokens: int
    reason: str
    replan: bool = False
    device_bytes: int = 0
    kv_bytes_per_token: int = 0

    def describe(self) -> str:
        return (
            f"Memory: {self.train_tokens_per_mb} tokens per training micro-batch, "
            f"{self.engine_kv_tokens} tokens of engine K/V ({self.reason})"
        )


def configured(train_tokens: int | None, engine_kv_tokens: int, why: str) -> MemoryPlan:
    """The plan off a GPU: the settings as given, train.max_tokens_per_mb unset meaning
    `CPU_TOKENS_PER_MB`."""
    return MemoryPlan(train_tokens or CPU_TOKENS_PER_MB, engine_kv_tokens, why)


def plan(
    *,
    total: int,
    free: int,
    sizes: ModelSizes,
    master: str,
    compute: str,
    autocast: bool,
    lora: bool,
    extra_models: int,
    engine_dtype: str | None,
    checkpointing: bool,
    train: bool = True,
    train_tokens: int | None,
    engine_cap: int,
    engine_fraction: float | None,
    device: str,
) -> MemoryPlan:
    """The plan on a GPU of `total` bytes with `free` bytes free (see the module
    docstring). `extra_models`: frozen copies of the model beside the trainer (KL
    reference, teacher), in `master`'s dtype; `engine_dtype` None: the engine is not on
    this device; `train` False: no trainer on it (a rollout-only command).
    `train_tokens`/`engine_fraction`: the user's settings, None when unset.
    Raises ValueError naming the settings when the fixed costs alone do not fit, or the
    engine's K/V would hold fewer than `MIN_TOKENS` tokens."""
    p, w = sizes.params, _BYTES[master]
    trainer = p * _BYTES[compute] if lora else p * (w + w + 8)  # weights, grads, AdamW
    if autocast and not lora:
        trainer += p * 2  # the bf16 copies of the weights autocast keeps for a forward
    fixed = trainer + extra_models * p * w if train else 0
    engine_weights = 2 * p * _BYTES[engine_dtype] if engine_dtype else 0  # copy + fused
    fixed += engine_weights
    usable = int(total * HEADROOM) - (total - free)  # HEADROOM of it, less what is in use
    left = usable - fixed
    gib = f"{total / _GIB:.0f} GiB {device}, {free / _GIB:.1f} GiB free"
    if left <= 0:
        raise ValueError(
            f"the model does not fit {device}: its weights, gradients, optimizer state and "
            f"engine copy need {fixed / _GIB:.1f} GiB of the {usable / _GIB:.1f} GiB usable "
            f"({gib}); use model.lora, a smaller model or another device (run.device)"
        )
    per_token = sizes.train_bytes_per_token(compute, checkpointing)
    share = (TRAIN_SHARE if engine_dtype else 1.0) if train else 0.0
    if not train:
        train_tokens, why_train = train_tokens or MIN_TOKENS, "no trainer"
    elif train_tokens is None:
        derived = int(left * share) // per_token // MIN_TOKENS * MIN_TOKENS
        train_tokens = min(max(derived, MIN_TOKENS), MAX_TOKENS_PER_MB)
        why_train = f"~{per_token / 2**20:.2f} MiB of activations per token"
    else:
        why_train = "train.max_tokens_per_mb"
    if engine_dtype is None:
        return MemoryPlan(train_tokens, engine_cap, f"{gib}; {why_train}; engine elsewhere")
    kv_per_token = sizes.kv_bytes_per_token(engine_dtype)
    if engine_fraction is not None:
        kv_bytes = int(engine_fraction * total) - engine_weights
        why_kv = f"engine.memory_fraction={engine_fraction:g}"
    else:
        kv_bytes = left - (train_tokens * per_token if train else 0)
        why_kv = "what the trainer's estimate leaves, resized after the first step"
    kv_tokens = min(kv_bytes // kv_per_token, engine_cap) if kv_bytes > 0 else 0
    if kv_tokens < MIN_TOKENS:
        raise ValueError(
            f"the engine's K/V would hold {max(kv_tokens, 0)} tokens on {device} ({gib}; "
            f"{why_kv}): lower train.max_tokens_per_mb, raise engine.memory_fraction, "
            "set train.activation_checkpointing=true or use model.lora"
        )
    reason = f"{gib}; {why_train}; K/V: {why_kv}"
    replan = train and engine_fraction is None
    return MemoryPlan(train_tokens, kv_tokens, reason, replan, total, kv_per_token)


def kv_tokens_after_step(
    *, total: int, peak: int, engine_kv_bytes: int, kv_bytes_per_token: int, cap: int
) -> int:
    """The engine's K/V budget in tokens once a train step measured `peak` bytes allocated
    on the device (everything: trainer, engine weights, the engine's K/V storage of
    `engine_kv_bytes`): the device's memory less headroom, less what the peak held
    besides the K/V, at most `cap`, at least `MIN_TOKENS`."""
    others = peak - engine_kv_bytes
    available = int(total * HEADROOM) - others
    return max(min(available // kv_bytes_per_token, cap), MIN_TOKENS)


@dataclass(frozen=True)
class DeviceMemory:
    """A GPU's memory as its allocator reports it, in bytes."""

    total: int
    free: int


def device_memory(device: torch.device) -> DeviceMemory | None:
    """Free and total memory of a CUDA `device`; None for any other (its budgets are the
    configured ones)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total, free)


def reset_peak(device: torch.device) -> None:
    """Start a new peak measurement on a CUDA `device` (nothing elsewhere)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_allocated(device: torch.device) -> int | None:
    """The allocator's peak bytes on a CUDA `device` since `reset_peak` (None elsewhere)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
