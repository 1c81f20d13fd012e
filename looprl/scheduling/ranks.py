"""Trainer ranks joining their torch.distributed group, and how a rank's failure is named.

`join_group` puts a rank in the default process group through a TCPStore, with
`diagnostics.collective_timeout_s` as every collective's timeout (torch's own default is
30 min); a CUDA device becomes the process's current device. `RankFailed` is what the
driver raises when a rank fails: the failing rank's own error, every rank stopped (the
Ray scheduler's RankGroup decides which rank is to blame; scheduling/ray.py).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class RankFailed(RuntimeError):
    """A rank failed; the others were stopped. `traceback` is the failing rank's own."""

    def __init__(self, message: str, rank: int, exit_codes: dict[int, int], tb: str | None):
        super().__init__(message)
        self.rank, self.exit_codes, self.traceback = rank, exit_codes, tb


def join_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    backend: str,
    device: torch.device,
    timeout_s: float,
) -> None:
    """Join the default process group through `store`, with `timeout_s` as every
    collective's timeout; a CUDA `device` becomes this process's current device."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
