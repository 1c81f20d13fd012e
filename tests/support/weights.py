"""Loading broadcast weights straight into a model, for the weight broadcast's tests (the
engines load them through `update_weights`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def apply_to_model(model: nn.Module) -> Callable[[dict[str, torch.Tensor]], None]:
    """A `load` for `WeightReceiver.receive`: copies each tensor, in place, into the
    parameter or persistent buffer of `model` of that name, cast to its dtype and device.

    Raises ValueError naming a tensor that `model` does not have or that has another
    shape. Tied names (`lm_head.weight` and `model.embed_tokens.weight`) are both in a
    Hugging Face model's state dict and are the same tensor: it is written twice.
    """
    targets = model.state_dict(keep_vars=True)
    kind = type(model).__name__

    def load(tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in tensors.items():
                target = targets.get(name)
                if target is None:
                    raise ValueError(
                        f"weight sync: received {name!r}, which {kind} has no parameter or "
                        f"buffer of; are trainer and engine the same architecture?"
                    )
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"weight sync: {name!r} arrived with shape {tuple(tensor.shape)}, "
                        f"but {kind} has it as {tuple(target.shape)}"
                    )
                target.copy_(tensor)

    return load
