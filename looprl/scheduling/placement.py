"""Placement planning: which node and GPUs each engine replica and trainer rank gets.

Owns the allocation string (`parse_allocation`), turning the scheduler and engine
fields plus the cluster's nodes into a concrete `Plan` (`resolve`, pure), and reading
the nodes of a connected Ray cluster (`cluster_nodes`). Does not start actors: the Ray
scheduler does, with each `Bundle.ray_options()`.

Allocation strings: `ENGINE:dN[tM]` and `fsdp:dK` joined by `+` (separate GPUs,
disaggregated) or `|` (shared GPUs, collocated): N engine replicas of M GPUs each
(tensor parallelism) and K trainer ranks of one GPU each: e.g. `vllm:d6+fsdp:d2` or
`vllm:d4t2|fsdp:d8` on 8 GPUs, `local:d1+fsdp:d2` on CPUs.

Rules, with G the cluster's GPUs, taken in node order (the order `nodes` has;
`cluster_nodes` puts the head first):
- trainer ranks (default 1) take the first K GPUs, one each, across nodes;
- disaggregated: engine replicas take the GPUs after them; collocated: the trainer's
  GPUs, each GPU then holding one trainer rank and at most one engine shard;
- a replica's M GPUs lie on one node (tensor parallelism does not cross machines):
  replicas are packed node by node, and GPUs too few on a node for one more replica
  stay free;
- engine replicas default to as many as fit there (G - K over M when disaggregated,
  K over M when collocated); more than fit is an error naming the counts, GPUs left
  unused are named in `Plan.warnings`;
- placement auto: disaggregated when the GPUs after the trainer's hold the replicas
  asked for (or one), else collocated;
- no GPUs anywhere: trainer ranks are dealt over the nodes in node order (rank r on
  node r mod the node count), engine replicas likewise, so a second node's CPUs work
  rather than idle while the head's are shared (one node: everything on it);
  collocated and disaggregated are then the same placement, tensor parallelism is
  refused, ranks use gloo.

What an actor asks Ray for (`Bundle.ray_options()`): its node (`node:<ip>`), a GPU
share, and the planned GPUs as its CUDA_VISIBLE_DEVICES. Disaggregated actors ask for
whole GPUs (1 per rank, M per replica), collocated ones for 0.5 (Ray cannot reserve
part of several GPUs for one actor, so a collocated replica with M > 1 is counted on
one GPU while its server uses all M; the node's total still adds up). Left to itself
Ray picks which GPUs an actor sees, and packs fractional shares onto the first GPU (two
collocated ranks would share GPU 0), so the options turn that off
(RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1) and set CUDA_VISIBLE_DEVICES to
`gpu_ids`: indices of the GPUs the node's Ray sees, which name the same devices when
it sees all of them (started without CUDA_VISIBLE_DEVICES, or with 0..N-1 in order).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from itertools import groupby
from typing import Literal

from looprl import runtime
from looprl.config import Config, ConfigError

Placement = Literal["collocated", "disaggregated"]
Device = tuple[str, int]  # (node IP, GPU index on that node)

_ENGINE_PART = re.compile(r"(?P<engine>[a-z]+):d(?P<replicas>\d+)(?:t(?P<tp>\d+))?")
_TRAINER_PART = re.compile(r"fsdp:d(?P<ranks>\d+)")
_SEPARATORS = {"+": "disaggregated", "|": "collocated"}
_COLLOCATED_SHARE = 0.5  # of one GPU, for each of its trainer rank and engine shard


@dataclass(frozen=True)
class Node:
    """One machine of the cluster: the IP Ray knows it by, its GPU and CPU counts."""

    ip: str
    gpus: int
    cpus: int = 1  # only for the actors' thread counts; placement goes by GPUs


@dataclass(frozen=True)
class Allocation:
    """A parsed allocation string."""

    engine: str
    engine_replicas: int
    tensor_parallel_size: int
    trainer_ranks: int
    placement: Placement

    def __str__(self) -> str:
        tp = f"t{self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        sep = "+" if self.placement == "disaggregated" else "|"
        return f"{self.engine}:d{self.engine_replicas}{tp}{sep}fsdp:d{self.trainer_ranks}"


@dataclass(frozen=True)
class Bundle:
    """Where one actor runs: an engine replica or a trainer rank.

    `gpu_ids` are indices on `node_ip` (empty on CPU); `num_gpus` is the share of them
    the actor asks Ray for (0.5 when collocated, see the module docstring).
    """

    role: Literal["engine", "trainer"]
    index: int  # replica index or trainer rank
    node_ip: str
    gpu_ids: tuple[int, ...]
    num_gpus: float

    def ray_options(self) -> dict:
        """Keyword arguments for `ActorClass.options(...)` that start it where planned."""
        options = {"num_gpus": self.num_gpus, "resources": {f"node:{self.node_ip}": 0.001}}
        env = runtime.forced_cpu_environment()  # LOOPRL_FORCE_CPU reaches actors on every node
        if self.gpu_ids:
            env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in self.gpu_ids)
        if env:
            options["runtime_env"] = {"env_vars": env}
        return options


@dataclass(frozen=True)
class Plan:
    """Every engine replica and trainer rank with its node and GPUs."""

    placement: Placement
    backend: Literal["nccl", "gloo"]  # torch.distributed backend of the trainer ranks
    tensor_parallel_size: int
    engines: tuple[Bundle, ...]
    trainers: tuple[Bundle, ...]  # trainer ranks, in rank order
    nodes: tuple[Node, ...]
    warnings: tuple[str, ...]

    @property
    def engine_replicas(self) -> int:
        return len(self.engines)

    @property
    def trainer_ranks(self) -> int:
        return len(self.trainers)

    @property
    def uses_gpus(self) -> bool:
        """Whether any actor is given GPUs (then every part runs on its GPU)."""
        return any(b.gpu_ids for b in (*self.engines, *self.trainers))

    def describe(self) -> str:
        """A few lines for the log: the placement, then where each actor runs."""
        gpus = sum(n.gpus for n in self.nodes)
        if gpus == 0:
            used = {b.node_ip for b in (*self.engines, *self.trainers)}
            where = ", ".join(n.ip for n in self.nodes if n.ip in used)
            head = (
                f"no GPUs in the cluster: {self.engine_replicas} engine replica(s) and "
                f"{self.trainer_ranks} trainer rank(s) on the CPUs of "
                f"{'node' if len(used) == 1 else 'nodes'} {where}, so collocated and "
                "disaggregated place them alike; trainer ranks use gloo"
            )
        else:
            head = (
                f"{self.placement} on {gpus} GPUs of {len(self.nodes)} node(s): "
                f"{self.engine_replicas} engine replica(s) x {self.tensor_parallel_size} "
                f"GPU(s), {self.trainer_ranks} trainer rank(s) over {self.backend}"
            )
        lines = [head]
        for b in (*self.trainers, *self.engines):
            name = "trainer rank" if b.role == "trainer" else "engine replica"
            where = _gpus(b.gpu_ids) if b.gpu_ids else "CPU"
            lines.append(f"  {name} {b.index}: node {b.node_ip} {where}")
        return "\n".join(lines)


def parse_allocation(text: str, engine_type: str) -> Allocation:
    """Parse `ENGINE:dN[tM]+fsdp:dK` (`|` instead of `+` for shared GPUs).

    >>> a = parse_allocation("vllm:d2t2+fsdp:d4", "vllm")
    >>> a.engine_replicas, a.tensor_parallel_size, a.trainer_ranks, a.placement
    (2, 2, 4, 'disaggregated')
    """
    example = (
        f"e.g. '{engine_type}:d2+fsdp:d2' (2 engine replicas and 2 trainer ranks on separate "
        f"GPUs), '{engine_type}:d2|fsdp:d2' (sharing them) or '{engine_type}:d2t2+fsdp:d4' "
        "(2 GPUs of tensor parallelism per replica)"
    )
    where = f"scheduler.allocation={text!r}"
    seps = [c for c in text if c in _SEPARATORS]
    if len(seps) != 1:
        raise ConfigError(
            f"{where} must be an engine part and a trainer part joined by one '+' (separate "
            f"GPUs) or '|' (shared GPUs); {example}"
        )
    engine_part, trainer_part = (p.strip() for p in text.split(seps[0]))
    if engine_part.startswith("fsdp:"):
        raise ConfigError(
            f"{where}: the engine part comes first, write "
            f"'{trainer_part}{seps[0]}{engine_part}'; {example}"
        )
    engine = _ENGINE_PART.fullmatch(engine_part)
    if engine is None:
        raise ConfigError(
            f"{where}: the engine part {engine_part!r} must read ENGINE:dN (N replicas) or "
            f"ENGINE:dNtM (M GPUs each); {example}"
        )
    trainer = _TRAINER_PART.fullmatch(trainer_part)
    if trainer is None:
        raise ConfigError(
            f"{where}: the trainer part {trainer_part!r} must read fsdp:dN (N ranks); {example}"
        )
    if engine["engine"] != engine_type:
        raise ConfigError(
            f"{where} names engine {engine['engine']!r}, and engine.type is {engine_type!r}; "
            f"write {engine_type!r} in the allocation or set engine.type={engine['engine']}"
        )
    replicas, ranks = int(engine["replicas"]), int(trainer["ranks"])
    tp = int(engine["tp"] or 1)
    for part, count in ((engine_part, replicas), (engine_part, tp), (trainer_part, ranks)):
        if count < 1:
            raise ConfigError(f"{where}: counts in {part!r} start at 1; {example}")
    if engine_type == "local" and tp > 1:
        raise ConfigError(
            f"{where} gives the local engine tensor parallelism (t{tp}); only vllm and "
            "sglang servers shard a model over GPUs, so drop the t part"
        )
    return Allocation(engine_type, replicas, tp, ranks, _SEPARATORS[seps[0]])


def resolve(cfg: Config, nodes: list[Node]) -> Plan:
    """The placement of `cfg`'s engine replicas and trainer ranks on `nodes` (module rules).

    Raises ConfigError naming the fields and counts when they cannot be placed, or when
    scheduler.allocation and an explicit field disagree.
    """
    if not nodes:
        raise ConfigError("the Ray cluster has no alive node to place the run on")
    replicas, ranks, asked, tp = _requested(cfg)
    devices = [(n.ip, g) for n in nodes for g in range(n.gpus)]
    if not devices:
        return _cpu_plan(cfg, nodes, replicas or 1, ranks, asked, tp)
    if ranks > len(devices):
        raise ConfigError(
            f"scheduler.trainer_ranks={ranks}{_from(cfg)} needs {ranks} GPUs (one per rank), "
            f"and the cluster has {len(devices)} ({_per_node(nodes)}); lower it to at most "
            f"{len(devices)}"
        )
    pools = {"collocated": devices[:ranks], "disaggregated": devices[ranks:]}
    room = {name: len(_pack(pool, None, tp)) for name, pool in pools.items()}
    placement = asked
    if asked == "auto":
        placement = "disaggregated" if room["disaggregated"] >= (replicas or 1) else "collocated"
    if room[placement] < (replicas or 1):
        raise ConfigError(_too_few(cfg, nodes, asked, replicas, ranks, tp, pools, room))
    groups = _pack(pools[placement], replicas, tp)
    collocated = placement == "collocated"
    rank_gpus = _COLLOCATED_SHARE if collocated else 1.0
    replica_gpus = _COLLOCATED_SHARE if collocated else float(tp)
    trainers = tuple(
        Bundle("trainer", rank, ip, (gpu,), rank_gpus)
        for rank, (ip, gpu) in enumerate(pools["collocated"])
    )
    engines = tuple(
        Bundle("engine", i, g[0][0], tuple(gpu for _, gpu in g), replica_gpus)
        for i, g in enumerate(groups)
    )
    warnings = _unused(cfg, devices, pools["collocated"], groups, placement, tp, room[placement])
    return Plan(placement, "nccl", tp, engines, trainers, tuple(nodes), tuple(warnings))


def cluster_nodes() -> list[Node]:
    """The alive nodes of the Ray cluster this process is connected to: head first, then by IP."""
    import ray  # here, not at the top: importing it takes ~1 s, and resolve needs none of it

    alive = [n for n in ray.nodes() if n["Alive"]]

    def order(n: dict) -> tuple:
        ip = ipaddress.ip_address(n["NodeManagerAddress"])
        return ("node:__internal_head__" not in n["Resources"], ip.version, ip)

    return [
        Node(
            n["NodeManagerAddress"],
            int(n["Resources"].get("GPU", 0)),
            int(n["Resources"].get("CPU", 1)),
        )
        for n in sorted(alive, key=order)
    ]


def _requested(cfg: Config) -> tuple[int | None, int, str, int]:
    """(engine_replicas or None, trainer_ranks, placement, tensor_parallel_size) asked for."""
    sched = cfg.scheduler
    replicas, ranks, placement = sched.engine_replicas, sched.trainer_ranks, sched.placement
    tp = cfg.engine.tensor_parallel_size
    if sched.allocation is None:
        return replicas, ranks or 1, placement, tp
    alloc = parse_allocation(sched.allocation, cfg.engine.type)
    # A field at its default (placement auto, tensor_parallel_size 1) counts as unset: a
    # saved config spells every field out.
    explicit = [
        ("scheduler.engine_replicas", replicas, None, alloc.engine_replicas),
        ("scheduler.trainer_ranks", ranks, None, alloc.trainer_ranks),
        ("scheduler.placement", placement, "auto", alloc.placement),
        ("engine.tensor_parallel_size", tp, 1, alloc.tensor_parallel_size),
    ]
    for name, value, unset, allocated in explicit:
        if value != unset and value != allocated:
            raise ConfigError(
                f"{name}={value} disagrees with scheduler.allocation={sched.allocation!r}, "
                f"which sets it to {allocated}; remove {name} (the allocation sets it) or "
                "change the allocation"
            )
    return alloc.engine_replicas, alloc.trainer_ranks, alloc.placement, alloc.tensor_parallel_size


def _cpu_plan(
    cfg: Config, nodes: list[Node], replicas: int, ranks: int, placement: str, tp: int
) -> Plan:
    if tp > 1:
        raise ConfigError(
            f"engine.tensor_parallel_size={tp}{_from(cfg)} shards the model over GPUs, and "
            f"the Ray cluster has none ({_per_node(nodes)}); on CPU use 1"
        )

    def ip(index: int) -> str:
        return nodes[index % len(nodes)].ip

    return Plan(
        "collocated" if placement == "auto" else placement,
        "gloo",
        1,
        tuple(Bundle("engine", i, ip(i), (), 0.0) for i in range(replicas)),
        tuple(Bundle("trainer", r, ip(r), (), 0.0) for r in range(ranks)),
        tuple(nodes),
        (),
    )


def _pack(pool: list[Device], replicas: int | None, tp: int) -> list[list[Device]]:
    """Groups of `tp` devices on one node each, in node order: `replicas`, or all that fit."""
    groups = []
    for _, on_node in groupby(pool, key=lambda d: d[0]):
        on_node = list(on_node)
        for start in range(0, len(on_node) - tp + 1, tp):
            if replicas is not None and len(groups) == replicas:
                return groups
            groups.append(on_node[start : start + tp])
    return groups


def _too_few(
    cfg: Config,
    nodes: list[Node],
    asked: str,
    replicas: int | None,
    ranks: int,
    tp: int,
    pools: dict[str, list[Device]],
    room: dict[str, int],
) -> str:
    """The error for engine replicas that do not fit where placement `asked` puts them."""
    wanted = replicas or 1
    engines = f"scheduler.engine_replicas={replicas}" if replicas else "one engine replica"
    need = (
        f"{engines} x engine.tensor_parallel_size={tp} need{'' if replicas else 's'} "
        f"{wanted * tp} GPUs, each replica's on one node"
    )
    apart = (
        f"the GPUs besides the trainer ranks' ({_count(pools['disaggregated'])}) have room "
        f"for {room['disaggregated']}"
    )
    shared = (
        f"the GPUs of scheduler.trainer_ranks={ranks} ({_count(pools['collocated'])}) have "
        f"room for {room['collocated']}"
    )
    best = max(room.values()) if asked == "auto" else room[asked]
    fixes = [f"lower scheduler.engine_replicas to {best}"] if best else []
    if asked == "disaggregated":
        where = apart
        fixes += ["lower scheduler.trainer_ranks", "use scheduler.placement=collocated"]
    elif asked == "collocated":
        where = f"collocated replicas share the trainer ranks' GPUs, and {shared}"
        fixes.append(f"raise scheduler.trainer_ranks to {wanted * tp}")
    else:
        where = f"{apart}, and {shared}"
        fixes.append(f"raise scheduler.trainer_ranks to {wanted * tp} (collocated)")
    fix = fixes[0] if len(fixes) == 1 else ", ".join(fixes[:-1]) + ", or " + fixes[-1]
    return (
        f"scheduler.placement={asked}{_from(cfg)}: {need}; {where} (the cluster: "
        f"{_per_node(nodes)}). {fix[0].upper()}{fix[1:]}"
    )


def _unused(
    cfg: Config,
    devices: list[Device],
    trainer_devices: list[Device],
    groups: list[list[Device]],
    placement: str,
    tp: int,
    room: int,
) -> list[str]:
    """Warnings naming GPUs nothing uses, and collocated GPUs without an engine shard."""
    engine_devices = {d for group in groups for d in group}
    ranks = len(trainer_devices)
    more_replicas = (
        f"Raise scheduler.engine_replicas to {room} (scheduler.allocation="
        f"'{Allocation(cfg.engine.type, room, tp, ranks, placement)}')"
    )
    warnings = []
    idle = [d for d in devices if d not in trainer_devices and d not in engine_devices]
    if idle:
        if placement == "collocated":
            full = Allocation(
                cfg.engine.type, len(_pack(devices, None, tp)), tp, len(devices), "collocated"
            )
            fix = (
                f"Raise scheduler.trainer_ranks to {len(devices)} (collocated engine replicas "
                f"share the trainer ranks' GPUs), e.g. scheduler.allocation='{full}'"
            )
        elif room > len(groups):
            fix = more_replicas
        else:
            fix = (
                f"No further replica of engine.tensor_parallel_size={tp} GPUs fits on one "
                "node; give them to scheduler.trainer_ranks or change "
                "engine.tensor_parallel_size"
            )
        warnings.append(f"{len(idle)} of {len(devices)} GPUs will be idle: {_where(idle)}. {fix}.")
    waiting = [d for d in trainer_devices if d not in engine_devices]
    if placement == "collocated" and waiting:
        fix = (
            more_replicas
            if room > len(groups)
            else f"A replica's engine.tensor_parallel_size={tp} GPUs must be on one node"
        )
        warnings.append(
            f"{len(waiting)} of the trainer ranks' {ranks} GPUs "
            f"{'holds' if len(waiting) == 1 else 'hold'} no engine replica and "
            f"{'waits' if len(waiting) == 1 else 'wait'} while rollouts generate: "
            f"{_where(waiting)}. {fix}."
        )
    return warnings


def _from(cfg: Config) -> str:
    alloc = cfg.scheduler.allocation
    return f" (from scheduler.allocation={alloc!r})" if alloc else ""


def _where(devices: list[Device]) -> str:
    """'node 10.0.0.2 GPUs 4, 5; node 10.0.0.3 GPUs 0' for (ip, gpu) pairs in node order."""
    return "; ".join(
        f"node {ip} {_gpus([gpu for _, gpu in on_node])}"
        for ip, on_node in groupby(devices, key=lambda d: d[0])
    )


def _gpus(ids: list[int] | tuple[int, ...]) -> str:
    """'GPU 3' or 'GPUs 4, 5'."""
    return ("GPU " if len(ids) == 1 else "GPUs ") + ", ".join(str(i) for i in ids)


def _per_node(nodes: list[Node]) -> str:
    return ", ".join(f"node {n.ip}: {n.gpus} GPU{'' if n.gpus == 1 else 's'}" for n in nodes)


def _count(devices: list[Device]) -> str:
    """'node 10.0.0.1: 6 GPUs' for the (ip, gpu) pairs given, or 'none'."""
    on_nodes = groupby(devices, key=lambda d: d[0])
    return _per_node([Node(ip, len(list(gpus))) for ip, gpus in on_nodes]) or "none"
