"""Process-wide settings for PyTorch on CPU: which instructions it may use, and how
glibc's malloc keeps memory. Imports no torch (looprl/__init__.py applies the first).

The instruction set: `LOOPRL_FORCE_CPU=avx2` runs looprl's processes as on an x86 CPU
with AVX2 and no AVX-512 (most laptops and many cloud VMs). There oneDNN cannot pack
bfloat16 weights ("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl
and avx512dq") and bfloat16 matmuls are emulated. Three variables, read by torch's
libraries when they first dispatch, reproduce that CPU on a newer x86 one:
`ATEN_CPU_CAPABILITY` (ATen's vectorized kernels), `ONEDNN_MAX_CPU_ISA` (oneDNN's JIT
kernels) and `MKL_ENABLE_INSTRUCTIONS` (MKL's). `apply_forced_cpu()` sets them before
torch runs an op; processes looprl starts inherit them, and Ray actors get them in their
runtime_env (`forced_cpu_environment()`). Nothing else reads LOOPRL_FORCE_CPU: the
precision probe (precision.py) finds out by itself what torch then does.

Memory: glibc's malloc serves allocations above a dynamic threshold with fresh `mmap`s and
returns freed memory at the top of the heap to the OS. A decode step frees and
reallocates several 12 MB float32 (batch x vocabulary) tensors, so each step paid for
thousands of page faults: sampling 64 rows took 12-16 ms, 3.3-3.5 ms with the settings
below (`bench/engine_choices.py`).
Freed memory now stays in the process for reuse (RSS does not shrink after a peak).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import platform
import sys

log = logging.getLogger(__name__)

FORCE_CPU_VARIABLE = "LOOPRL_FORCE_CPU"
FORCED_CPU_SETTINGS = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
}


class ForcedCPUError(RuntimeError):
    """LOOPRL_FORCE_CPU asks for something this process cannot do."""


def forced_cpu() -> str | None:
    """The forced CPU kind ('avx2'), or None when the machine runs as it is."""
    value = os.environ.get(FORCE_CPU_VARIABLE, "").strip().lower()
    if value in ("", "0", "none", "off"):
        return None
    if value not in FORCED_CPU_SETTINGS:
        raise ForcedCPUError(
            f"{FORCE_CPU_VARIABLE}={value!r} is not one of {', '.join(FORCED_CPU_SETTINGS)}; "
            "unset it to run on this CPU as it is"
        )
    return value


def forced_cpu_environment() -> dict[str, str]:
    """The variables that make a child process run as this one (empty when not forced)."""
    kind = forced_cpu()
    return {} if kind is None else {FORCE_CPU_VARIABLE: kind, **FORCED_CPU_SETTINGS[kind]}


def apply_forced_cpu() -> None:
    """Set the variables for `LOOPRL_FORCE_CPU` in this process's environment.

    Raises ForcedCPUError on a machine that is not x86, or when torch already ran ops
    with a wider instruction set (the variables would come too late to take effect)."""
    kind = forced_cpu()
    if kind is None:
        return
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        raise ForcedCPUError(
            f"{FORCE_CPU_VARIABLE}={kind} reproduces an x86 CPU with AVX2 only; this machine is "
            f"{machine}: unset {FORCE_CPU_VARIABLE}"
        )
    os.environ.update(FORCED_CPU_SETTINGS[kind])
    torch = sys.modules.get("torch")
    if torch is not None:
        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in ("AVX2", "DEFAULT"):
            settings = " ".join(f"{k}={v}" for k, v in FORCED_CPU_SETTINGS[kind].items())
            raise ForcedCPUError(
                f"{FORCE_CPU_VARIABLE}={kind} came too late: torch was imported and already runs "
                f"with {capability} kernels. Import looprl before torch, or set {settings} "
                "in the environment before Python starts"
            )


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # from glibc's malloc.h
_MMAP_THRESHOLD = 32 * 2**20  # glibc's maximum on 64-bit
_TRIM_THRESHOLD = 2**30
_tuned = False


def tune_malloc() -> None:
    """Keep large freed blocks in the heap (glibc only; elsewhere a no-op). Idempotent."""
    global _tuned
    if _tuned or not sys.platform.startswith("linux"):
        return
    _tuned = True
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        return
    if not (
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    ):
        log.debug("mallopt refused the thresholds; large allocations stay mmap-backed")


def release_free_memory() -> None:
    """Give the heap's free memory back to the OS (glibc `malloc_trim`; elsewhere a no-op).

    For a process that just dropped a large transient copy it will not need again soon:
    a trainer rank after gathering the full state dict for a checkpoint (1.6 GB for
    SmolLM2-135M with AdamW) would otherwise keep it, as tune_malloc asks."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
