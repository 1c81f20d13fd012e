"""LoRA around the trainer's model, with peft (`model.lora`).

Owns wrapping the policy (`add_adapters`): peft's `get_peft_model` injects adapters
into the model, every base weight is frozen and held once, in the dtype the trainer
computes in (bfloat16 under bf16 autocast: frozen weights need no float32 master copy),
while the adapters stay float32 (peft's `autocast_adapter_dtype`) and are the only
parameters the optimizer sees. Also the adapter as engines and checkpoints take it
(`adapter_of`, `adapter_state`, `load_adapter_state`) and the folders a run ends with
(`save_outputs`, `save_merged`). The KL reference is the same model with its adapters
turned off (`reference_forward`), so no second copy is loaded. Does not own applying
adapters while sampling (the engines) nor the folder format (adapters.py).
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from looprl import adapters
from looprl.config import LoraConfig
from looprl.models import load_model
from looprl.types import LoraAdapter

if TYPE_CHECKING:  # peft is the lora extra, imported only where adapters are added
    from peft import PeftModel

_ADAPTER = "default"  # peft's adapter name
_PEFT_PREFIX = "base_model.model."  # where a PeftModel keeps the model it wraps


def add_adapters(model: nn.Module, cfg: LoraConfig, frozen_dtype: torch.dtype) -> PeftModel:
    """`model` with LoRA adapters (float32) on `cfg.target_modules`, its own weights
    frozen and cast to `frozen_dtype`. The model is changed in place and wrapped."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    model.requires_grad_(False)
    model.to(frozen_dtype)
    try:
        peft_model = get_peft_model(
            model,
            PeftLoraConfig(
                task_type="CAUSAL_LM",
                r=cfg.rank,
                lora_alpha=cfg.scale_alpha,
                lora_dropout=cfg.dropout,
                target_modules=cfg.target_modules,
                base_model_name_or_path=model.name_or_path,
            ),
            autocast_adapter_dtype=True,  # adapters in float32 whatever the base's dtype
        )
    except ValueError as e:  # peft's message names the modules it found, or not
        raise ValueError(f"model.lora.target_modules={cfg.target_modules!r}: {e}") from e
    return peft_model


def is_lora(model: nn.Module) -> bool:
    peft = sys.modules.get("peft")  # not imported: no model can be one of its
    return peft is not None and isinstance(model, peft.PeftModel)


def adapter_of(model: PeftModel, state: dict[str, torch.Tensor] | None = None) -> LoraAdapter:
    """The adapter as engines take it: its tensors (`state`, default `adapter_state`)
    under the adapted modules' own names."""
    cfg = model.peft_config[_ADAPTER]
    state = adapter_state(model) if state is None else state
    tensors = {
        name.removeprefix(_PEFT_PREFIX).replace(f".{_ADAPTER}.", "."): t
        for name, t in state.items()
    }
    return LoraAdapter(
        tensors, rank=cfg.r, alpha=float(cfg.lora_alpha), target_modules=tuple(cfg.target_modules)
    )


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's parameters by name (detached, sharing storage with the live ones: a
    reader copies them), for a checkpoint or an engine; the frozen base is left out."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def check_adapter_state(model: PeftModel, state: dict[str, torch.Tensor]) -> None:
    """Raise naming what does not match if `state` is not this model's adapter state."""
    expected = set(adapter_state(model))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(
            f"the checkpoint's adapter does not match model.lora: missing {missing[:3]}, "
            f"unexpected {extra[:3]} (a full-weight checkpoint, or another rank or targets?)"
        )


def load_adapter_state(model: PeftModel, state: dict[str, torch.Tensor]) -> None:
    """Load what `adapter_state` saved; raises naming what does not match."""
    check_adapter_state(model, state)
    model.load_state_dict(state, strict=False)


def base_path(model: PeftModel) -> str:
    """The folder of the base model the adapter belongs to."""
    return model.peft_config[_ADAPTER].base_model_name_or_path


def reference_forward(model: PeftModel) -> AbstractContextManager:
    """Inside it, `model` computes as its frozen base: the KL reference policy."""
    return model.disable_adapter()


def save_outputs(
    adapter: LoraAdapter, base: str, tokenizer, out: Path, *, merged: bool = False
) -> Path:
    """What a LoRA run ends with: `adapter` of the model at `base` as a peft folder `out`
    with the tokenizer, and with `merged` also `<out>-merged`, a plain Hugging Face
    folder of the base with the adapter merged in (in float32, read again from `base`)."""
    adapters.write_folder(adapter, out, base)
    tokenizer.save_pretrained(out)
    if merged:
        save_merged(adapter, base, tokenizer, out.with_name(f"{out.name}-merged"))
    return out


def save_merged(adapter: LoraAdapter, base: str, tokenizer, out: Path) -> Path:
    """The model at `base` with `adapter` merged in, as a plain Hugging Face folder."""
    model = load_model(base)
    model.load_state_dict(adapters.merge(model.state_dict(), adapter))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
