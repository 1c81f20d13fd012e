"""Whether this process reaches every node of a Ray cluster at the address it announced.

A node announces one IP (`ray start --node-ip-address`, else the one Ray guesses); the
head, the driver and every peer connect to it there: to its raylet, to its actors, to
the TCPStore or gloo sockets of a trainer rank on it. A node that announced an address
its peers cannot reach (the wrong interface of a multi-homed machine, a private one
behind NAT) still registers, because it dials the head itself. Then, seen on this
machine with Ray 2.60: it shows as alive for about 20 s while the head's health checks
fail, and is marked dead after 5 of them (`RAY_health_check_failure_threshold`); a run
planned in that window waits forever for actors that cannot start there, and one
started later trains on fewer nodes than the cluster was given, silently.

`unreachable_nodes` tries a TCP connection to each alive node's raylet port (the
address Ray itself uses) with a short timeout, all at once; `unreachable_message`
says which node, what it announced, and the fix. `looprl doctor` reports it, and the
Ray scheduler refuses to place a run on such a cluster (scheduling/ray.py).
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

CONNECT_TIMEOUT_S = 3.0


class NodeUnreachable(RuntimeError):
    """A node of the Ray cluster cannot be reached at the address it announced; the
    message names each such node and the fix."""


@dataclass(frozen=True)
class RayNode:
    """A node as Ray lists it: the name it was given and the raylet's announced address."""

    name: str  # NodeName: the announced IP unless `ray start --node-name`
    ip: str  # NodeManagerAddress
    port: int  # NodeManagerPort: the raylet's
    head: bool = False

    @property
    def label(self) -> str:
        kind = "head node" if self.head else "node"
        return f"{kind} {self.name}" if self.name == self.ip else f"{kind} {self.name} ({self.ip})"


def alive_nodes(listed: list[dict] | None = None) -> list[RayNode]:
    """The alive nodes among `listed` (`ray.nodes()`, by default of the cluster this
    process is connected to: `ray.init` first), the head first."""
    if listed is None:
        import ray

        listed = ray.nodes()
    nodes = [
        RayNode(
            n["NodeName"],
            n["NodeManagerAddress"],
            int(n["NodeManagerPort"]),
            "node:__internal_head__" in n["Resources"],
        )
        for n in listed
        if n["Alive"]
    ]
    return sorted(nodes, key=lambda n: not n.head)


def connect_error(ip: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why a TCP connection to ip:port failed within `timeout_s`, or None if it opened."""
    try:
        socket.create_connection((ip, port), timeout=timeout_s).close()
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as e:
        return e.strerror or str(e)
    return None


def unreachable_nodes(
    nodes: list[RayNode], timeout_s: float = CONNECT_TIMEOUT_S
) -> list[tuple[RayNode, str]]:
    """The nodes whose raylet this process cannot connect to, each with why, tried at
    once (so the whole check takes at most `timeout_s`)."""
    if not nodes:
        return []
    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        errors = list(pool.map(lambda n: connect_error(n.ip, n.port, timeout_s), nodes))
    return [(n, e) for n, e in zip(nodes, errors, strict=True) if e is not None]


def check_cluster(head: str | None, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise NodeUnreachable naming every alive node of the connected cluster that this
    process cannot reach; `head`: the cluster's address, for the fix."""
    bad = unreachable_nodes(alive_nodes(), timeout_s)
    if bad:
        raise NodeUnreachable("\n".join(unreachable_message(n, e, head) for n, e in bad))


def unreachable_message(node: RayNode, error: str, head: str | None) -> str:
    """What is wrong with `node` (`error`: why it cannot be reached) and the fix; `head`:
    the cluster's address (host:port), for the command."""
    return f"{unreachable_problem(node, error)}. {unreachable_fix(head)}"


def unreachable_problem(node: RayNode, error: str) -> str:
    return (
        f"Ray {node.label} announced the address {node.ip}, and this machine cannot reach "
        f"it ({node.ip}:{node.port}, its raylet: {error}); actors placed there would never "
        "start or answer"
    )


def unreachable_fix(head: str | None) -> str:
    join = f"--address={head} " if head else ""
    return (
        f"Restart that node with `ray start {join}--node-ip-address=<an address of that "
        "machine the head reaches>` (with examples/slurm/looprl.sbatch, set "
        "LOOPRL_NET_IFACE=<the interface of the network the nodes share>)"
    )
