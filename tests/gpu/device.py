"""Where the tests marked `gpu` (tests/gpu) run: on the first CUDA device, or, to check
the tests themselves on a machine without one, on the CPU when LOOPRL_GPU_TESTS_ON=cpu
(never set by `make test`). tests/conftest.py skips them where neither holds."""

from __future__ import annotations

import os

import pytest
import torch

GPU_TESTS_ON = "LOOPRL_GPU_TESTS_ON"


def on_cpu() -> bool:
    """Whether LOOPRL_GPU_TESTS_ON asks for the CPU; any other value than cpu is refused."""
    value = os.environ.get(GPU_TESTS_ON, "")
    if value not in ("", "cpu"):
        raise pytest.UsageError(
            f"{GPU_TESTS_ON}={value!r}: the only value is cpu (run the gpu tests on the CPU); "
            "unset it to run them on the GPU"
        )
    return value == "cpu"


def skip_reason() -> str | None:
    """Why the gpu tests cannot run here, or None when they can."""
    if on_cpu() or torch.cuda.is_available():
        return None
    return (
        "needs a CUDA GPU: torch.cuda.is_available() is False here; run `make test-gpu` on "
        f"a GPU machine (docs/gpu.md), or {GPU_TESTS_ON}=cpu to run it on this CPU"
    )


def device_for_tests() -> torch.device:
    """cuda:0, or the CPU under LOOPRL_GPU_TESTS_ON=cpu."""
    return torch.device("cpu") if on_cpu() else torch.device("cuda", 0)
