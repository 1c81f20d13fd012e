"""Trainer ranks joining their torch.distributed group, and how a rank's failure is named.

`use_interface_of` makes gloo in an actor's process use the network interface of its
node's announced IP. `join_group` puts a rank in the default process group through a TCPStore, with
`diagnostics.collective_timeout_s` as every collective's timeout (torch's own default is
30 min); a CUDA device becomes the process's current device. `RankFailed` is what the
driver raises when a rank fails: the failing rank's own error, every rank stopped (the
Ray scheduler's RankGroup decides which rank is to blame; scheduling/ray.py).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist

GLOO_INTERFACE_VARIABLE = "GLOO_SOCKET_IFNAME"


class RankFailed(RuntimeError):
    """A rank failed; the others were stopped. `traceback` is the failing rank's own."""

    def __init__(self, message: str, rank: int, exit_codes: dict[int, int], tb: str | None):
        super().__init__(message)
        self.rank, self.exit_codes, self.traceback = rank, exit_codes, tb


def use_interface_of(ip: str) -> str | None:
    """Make gloo in this process listen on the interface holding `ip` (the node's IP as
    Ray announces it), unless GLOO_SOCKET_IFNAME is set; returns the interface used.

    Left to itself gloo listens on the address this machine's hostname resolves to, and
    on loopback where that is not one of its own: where the hostname resolves to
    127.0.x.x (Debian's /etc/hosts), a rank tells its peers on other nodes to connect to
    127.0.0.1, and the group fails with "Connection refused, remote=[127.0.0.1]". Both
    process groups of an actor (the trainer ranks', the weight broadcast's) read the
    variable when they are made."""
    chosen = os.environ.get(GLOO_INTERFACE_VARIABLE)
    if chosen:
        return chosen
    wanted = ipaddress.ip_address(ip)
    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            inet = address.family in (socket.AF_INET, socket.AF_INET6)
            if inet and ipaddress.ip_address(address.address.split("%")[0]) == wanted:
                os.environ[GLOO_INTERFACE_VARIABLE] = name
                return name
    return None  # not an address of this machine (NAT): gloo's own choice


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
