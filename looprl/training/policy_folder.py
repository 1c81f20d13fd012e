"""`save_policy`: a trained policy written as a folder other tools load: a Hugging Face
folder (safetensors, tokenizer, chat template), or with LoRA the adapter as a peft
folder (and, asked for, the adapter merged into its base beside it). Every command
that trains ends with it (looprl train, looprl sft; under Ray, the driver)."""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from looprl.training import lora

log = logging.getLogger(__name__)


def save_policy(model: nn.Module, tokenizer, out: Path, *, merged: bool = False) -> Path:
    """Save as a Hugging Face folder (safetensors, tokenizer, chat template). A model with
    LoRA adapters is saved as its adapter folder, and with `merged` also merged into the
    base as a plain folder `<out>-merged`."""
    if not lora.is_lora(model):
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        return out
    lora.save_outputs(lora.adapter_of(model), lora.base_path(model), tokenizer, out, merged=merged)
    if merged:
        log.info("Saved the policy merged with its adapter to %s-merged", out)
    return out
