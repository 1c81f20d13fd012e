"""LoRA adapters outside the trainer: merged into base weights, and as folders on disk.

Owns `merge` (each adapted weight W becomes W + scaling * B @ A, computed in float32)
and the adapter folder in peft's format (`write_folder`, `read_folder`:
adapter_config.json + adapter_model.safetensors, tensors named
`base_model.model.<module>.lora_A.weight`), which `peft.PeftModel.from_pretrained` and
vLLM's LoRA loading read. A `LoraAdapter` (types.py) names tensors by module, without
peft's prefix. Does not own training adapters (training/lora.py wraps the trainer's
model with peft) nor applying them while sampling (each engine does: the local engine
by merging it into its fused weights, rebuilt from an untouched base copy at each
version, or as a low-rank term in the Hugging Face forward; vLLM by loading the folder by
name).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported on use: the start-up checks read folders without torch
    import torch

    from looprl.types import LoraAdapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # peft's name for the model inside a PeftModel


def is_adapter_folder(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def merge(state_dict: dict[str, torch.Tensor], adapter: LoraAdapter) -> dict[str, torch.Tensor]:
    """A copy of `state_dict` with `adapter` merged into each weight it adapts (W + scaling
    B @ A in float32, then back to W's dtype); the other tensors are shared, not copied."""
    import torch

    merged = dict(state_dict)
    for module in adapter.modules():
        key = f"{module}.weight"
        if key not in state_dict:
            raise ValueError(
                f"the adapter adapts {module!r}, but the base weights have no {key!r}: it "
                "was trained on another model"
            )
        weight = state_dict[key]
        a = adapter.tensors[f"{module}.lora_A.weight"].to(weight.device, torch.float32)
        b = adapter.tensors[f"{module}.lora_B.weight"].to(weight.device, torch.float32)
        merged[key] = (weight.float() + adapter.scaling * (b @ a)).to(weight.dtype)
    return merged


def write_folder(adapter: LoraAdapter, out: Path, base_model: str | Path) -> Path:
    """Write `adapter` as a peft adapter folder `out` for the model at `base_model`."""
    from peft import LoraConfig  # the config file's exact format is peft's
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    LoraConfig(
        task_type="CAUSAL_LM",
        r=adapter.rank,
        lora_alpha=adapter.alpha,
        target_modules=sorted(adapter.target_modules),
        base_model_name_or_path=str(base_model),
        inference_mode=True,
    ).save_pretrained(out)
    tensors = {
        _PREFIX + name: t.detach().to("cpu").contiguous() for name, t in adapter.tensors.items()
    }
    save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})
    return out


def read_folder(path: str | Path) -> tuple[LoraAdapter, str]:
    """The adapter in peft folder `path`, and the base model path its config names."""
    from safetensors.torch import load_file

    from looprl.types import LoraAdapter

    path = Path(path)
    config = _read_config(path)
    tensors = {name.removeprefix(_PREFIX): t for name, t in load_file(path / WEIGHTS_FILE).items()}
    adapter = LoraAdapter(
        tensors,
        rank=int(config["r"]),
        alpha=float(config["lora_alpha"]),
        target_modules=tuple(config["target_modules"]),
    )
    return adapter, base_of(path)


def base_of(path: str | Path) -> str:
    """The base model path the adapter folder's config names ('' when it names none);
    reads the config only."""
    return _read_config(Path(path)).get("base_model_name_or_path") or ""


def _read_config(path: Path) -> dict:
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
        int(config["r"]), float(config["lora_alpha"]), config["target_modules"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path / CONFIG_FILE} is not a LoRA adapter config: {e}") from e
    if isinstance(config["target_modules"], str):  # peft also allows a regex or 'all-linear'
        raise ValueError(
            f"{path / CONFIG_FILE}: target_modules={config['target_modules']!r}; looprl reads "
            "adapters whose target_modules is a list of module names"
        )
    if config.get("use_dora") or config.get("use_rslora") or config.get("modules_to_save"):
        raise ValueError(
            f"{path / CONFIG_FILE}: DoRA, rsLoRA and modules_to_save are not supported"
        )
    return config
