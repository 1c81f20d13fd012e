"""`LOOPRL_FORCE_CPU=avx2`: run looprl's processes as on an x86 CPU with AVX2 and no AVX-512.

Most laptops and many cloud VMs have AVX2 only. There oneDNN cannot pack bfloat16
weights ("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and
avx512dq") and bfloat16 matmuls are emulated, many times slower than float32. Three
variables, read by torch's libraries when they first dispatch, reproduce that CPU on
a newer x86 one: `ATEN_CPU_CAPABILITY` (ATen's vectorized kernels),
`ONEDNN_MAX_CPU_ISA` (oneDNN's JIT kernels) and `MKL_ENABLE_INSTRUCTIONS` (MKL's).

`looprl/__init__.py` calls `apply()` before anything of looprl imports torch; processes
looprl starts inherit the variables through the environment, and Ray actors get them
through their runtime_env (`environment()`). Nothing else reads LOOPRL_FORCE_CPU: the
precision probe (`precision.py`) finds out by itself what torch then does.

This module must not import torch.
"""

from __future__ import annotations

import os
import platform
import sys

VARIABLE = "LOOPRL_FORCE_CPU"
SETTINGS = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
}


class ForcedCPUError(RuntimeError):
    """LOOPRL_FORCE_CPU asks for something this process cannot do."""


def requested() -> str | None:
    """The forced CPU kind ('avx2'), or None when the machine runs as it is."""
    value = os.environ.get(VARIABLE, "").strip().lower()
    if value in ("", "0", "none", "off"):
        return None
    if value not in SETTINGS:
        raise ForcedCPUError(
            f"{VARIABLE}={value!r} is not one of {', '.join(SETTINGS)}; unset it to run on "
            "this CPU as it is"
        )
    return value


def environment() -> dict[str, str]:
    """The variables that make a child process run as this one (empty when not forced)."""
    kind = requested()
    return {} if kind is None else {VARIABLE: kind, **SETTINGS[kind]}


def apply() -> None:
    """Set the variables for `LOOPRL_FORCE_CPU` in this process's environment.

    Raises ForcedCPUError on a machine that is not x86, or when torch already ran ops
    with a wider instruction set (the variables would come too late to take effect)."""
    kind = requested()
    if kind is None:
        return
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        raise ForcedCPUError(
            f"{VARIABLE}={kind} reproduces an x86 CPU with AVX2 only; this machine is "
            f"{machine}: unset {VARIABLE}"
        )
    os.environ.update(SETTINGS[kind])
    torch = sys.modules.get("torch")
    if torch is not None:
        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in ("AVX2", "DEFAULT"):
            settings = " ".join(f"{k}={v}" for k, v in SETTINGS[kind].items())
            raise ForcedCPUError(
                f"{VARIABLE}={kind} came too late: torch was imported and already runs "
                f"with {capability} kernels. Import looprl before torch, or set {settings} "
                "in the environment before Python starts"
            )
