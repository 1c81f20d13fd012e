"""Process-wide settings that make PyTorch on CPU fast; applied by the engine and trainer.

glibc's malloc serves allocations above a dynamic threshold with fresh `mmap`s and
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
import sys

log = logging.getLogger(__name__)

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
