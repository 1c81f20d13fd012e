"""Weight sync by broadcast: trainer rank 0 sends the full weights to N engine replicas.

Owns: a standalone process group of {trainer rank 0 (rank 0), replicas (ranks 1..N)}
over its own TCPStore (`weight_sync_group`), the plan that cuts a state dict into
buckets of one dtype (`plan_buckets`), and the sender and receiver of one version
(`WeightSender.send`, `WeightReceiver.receive`, which hands each bucket to a `load`; an
engine replica copies them and loads them with `update_weights`). Does not own when to
sync, pausing an engine around the load, or telling replicas to call `receive`
(scheduling/ray.py does).

Why standalone. The trainer rank is already in the default process group (its FSDP
data-parallel group), and torch.distributed has one default group per process. So the
group's backend object (`ProcessGroupGloo`, `ProcessGroupNCCL`) is constructed directly
on a TCPStore that trainer rank 0 hosts, without `init_process_group` or `new_group`,
and its `broadcast([tensor], options).wait()` is called directly; the default group is
never touched. Gloo on CPU, NCCL on GPU: the same code, only the backend and the
device of the buffers differ (the NCCL path is not exercised by the tests).

What one `send` broadcasts, from rank 0, in this order:
1. the header's length in bytes, one int64;
2. the header, UTF-8 JSON as uint8: `{"version": int, "tied": {alias: source},
   "buckets": [[dtype, [[name, shape], ...]], ...]}`, dtype as in `torch.<dtype>`;
   JSON, not pickle, so a receiver never runs code that came over the network;
3. each bucket, its tensors flattened into one contiguous buffer, in header order.
Names that share storage with an earlier name (tied embeddings: `lm_head.weight` is
`model.embed_tokens.weight`) are sent once and listed in `tied`; the receiver hands the
same tensor to `load` under both names.

Memory: each side holds one buffer the size of the largest bucket, reused for every
bucket, so at most one bucket is in flight; the receiver never holds the whole model
beside its own.

Timeouts: every broadcast waits at most the group's `timeout_s` for its peers, so
replicas call `receive` around the time the trainer calls `send` (they are told to),
not long before. (With NCCL, torch's watchdog by default ends a process whose
collective timed out.)
"""

from __future__ import annotations

import json
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend

BUCKET_BYTES = 32 * 2**20  # gloo on 2 CPU cores: 1-64 MiB alike, 256 MiB 2-3x slower
BACKENDS = ("gloo", "nccl")

TensorSpec = tuple[str, tuple[int, ...], torch.dtype]  # (name, shape, dtype)


class WeightSyncError(RuntimeError):
    """The weight sync group could not form, or a broadcast in it failed; the message
    names the group's address and the rank."""


@dataclass(frozen=True)
class Bucket:
    """Tensors of one dtype sent as one flat buffer: `tensors` are (name, shape) pairs."""

    dtype: torch.dtype
    tensors: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.tensors)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor of this bucket as a view into `buffer` (at least `numel` long)."""
        views, offset = {}, 0
        for name, shape in self.tensors:
            numel = math.prod(shape)
            views[name] = buffer[offset : offset + numel].view(shape)
            offset += numel
        return views


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Cut `specs` ((name, shape, dtype), in order) into buckets, keeping the order.

    A bucket holds consecutive tensors of one dtype whose bytes sum to at most
    `bucket_bytes`; a new bucket starts where the dtype changes or the next tensor would
    not fit. A tensor bigger than `bucket_bytes` gets a bucket of its own.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    buckets: list[Bucket] = []
    dtype, tensors, nbytes = None, [], 0
    for name, shape, tensor_dtype in specs:
        size = math.prod(shape) * tensor_dtype.itemsize
        if tensors and (tensor_dtype != dtype or nbytes + size > bucket_bytes):
            buckets.append(Bucket(dtype, tuple(tensors)))
            tensors, nbytes = [], 0
        dtype = tensor_dtype
        tensors.append((name, tuple(shape)))
        nbytes += size
    if tensors:
        buckets.append(Bucket(dtype, tuple(tensors)))
    return buckets


@dataclass(frozen=True)
class WeightSyncGroup:
    """One rank's handle on the standalone group: rank 0 sends, ranks 1.. receive."""

    backend: Backend  # ProcessGroupGloo or ProcessGroupNCCL, in no torch.distributed group
    store: dist.TCPStore  # kept alive with the group: rank 0's hosts it
    rank: int
    world_size: int
    device: torch.device  # where buffers live: cpu for gloo, this process's GPU for nccl
    address: str  # "host:port" of rank 0's store, for error messages

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        """Broadcast `tensor` from rank 0 in place; `what` names it in an error."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        try:
            self.backend.broadcast([tensor], options).wait()
        except RuntimeError as e:
            raise WeightSyncError(
                f"weight sync group at {self.address}, rank {self.rank} of {self.world_size}: "
                f"broadcast of {what} failed (a peer died or did not take part within the "
                f"group's timeout): {e}"
            ) from e


def weight_sync_group(
    host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float
) -> WeightSyncGroup:
    """Join the group of `world_size` ranks whose rank 0 hosts a TCPStore on host:port.

    Rank 0 (trainer rank 0) listens on `port`; ranks 1.. (the replicas) connect to
    `host`. Returns once every rank has joined; raises WeightSyncError naming the
    address and the missing ranks when they have not within `timeout_s` (also the
    timeout of every later broadcast). With nccl, call `torch.cuda.set_device` first:
    buffers go on the current GPU.
    """
    if backend not in BACKENDS:
        raise ValueError(f"weight sync backend={backend!r} must be one of {BACKENDS}")
    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank={rank}, world_size={world_size}: a weight sync group is the trainer "
            f"(rank 0) and at least one replica, so world_size >= 2 and 0 <= rank < world_size"
        )
    address = f"{host}:{port}"
    where = f"weight sync group at {address} (rank {rank} of {world_size})"
    deadline = time.monotonic() + timeout_s
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        try:
            store = dist.TCPStore(
                host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False
            )
        except dist.DistError as e:
            raise WeightSyncError(f"{where}: cannot listen on port {port}: {e}") from e
    else:
        _wait_until_listening(host, port, timeout_s, where)
        store = dist.TCPStore(
            host, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False
        )
    # Our own join barrier, for both backends: it names the missing ranks, and NCCL
    # (which connects only at the first broadcast) would otherwise fail later.
    store.set(f"joined/{rank}", "1")
    try:
        store.wait(
            [f"joined/{r}" for r in range(world_size)],
            timedelta(seconds=max(deadline - time.monotonic(), 0.001)),
        )
    except dist.DistStoreError as e:
        missing = [r for r in range(world_size) if not store.check([f"joined/{r}"])]
        raise WeightSyncError(
            f"{where}: rank(s) {missing} did not join within {timeout_s:g} s; every replica "
            f"must call weight_sync_group({host!r}, {port}, ...) with world_size={world_size}"
        ) from e
    if backend == "gloo":
        try:
            group_backend: Backend = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        except RuntimeError as e:
            raise WeightSyncError(
                f"{where}: every rank joined, but gloo could not connect them to each other "
                f"({e}); on several machines, set GLOO_SOCKET_IFNAME to the network "
                f"interface they reach each other on"
            ) from e
        device = torch.device("cpu")
    else:
        from torch.distributed import ProcessGroupNCCL  # absent from CPU-only builds

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        options.is_high_priority_stream = False
        # NCCL's communicator is created at the first broadcast, on the current GPU.
        group_backend = ProcessGroupNCCL(store, rank, world_size, options)
        device = torch.device("cuda", torch.cuda.current_device())
    return WeightSyncGroup(group_backend, store, rank, world_size, device, address)


def _wait_until_listening(host: str, port: int, timeout_s: float, where: str) -> None:
    """Return once host:port accepts a connection; raise after `timeout_s`. (TCPStore's
    own client retries past its timeout: measured 6.7 s for a 3 s timeout.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            remaining_s = max(deadline - time.monotonic(), 0.01)
            socket.create_connection((host, port), timeout=remaining_s).close()
            return  # the store's server ignores a connection closed at once
        except OSError as e:
            if time.monotonic() >= deadline:
                raise WeightSyncError(
                    f"{where}: rank 0 (the trainer) did not open it within {timeout_s:g} s: "
                    f"nothing accepted a connection to {host}:{port} ({e}). Check that the "
                    f"trainer is running and that this machine reaches {host}:{port}"
                ) from e
            time.sleep(0.05)


class WeightSender:
    """Sends state dicts from rank 0 of `group` in buckets of at most `bucket_bytes`."""

    def __init__(self, group: WeightSyncGroup, bucket_bytes: int = BUCKET_BYTES) -> None:
        if group.rank != 0:
            raise ValueError(f"a WeightSender runs on rank 0 of the group, not rank {group.rank}")
        self.group = group
        self.bucket_bytes = bucket_bytes

    def send(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Broadcast `state_dict` (full tensors, as an FSDP model's gathered state dict,
        on any device) as policy version `version`; returns when every bucket has been
        handed to the backend (gloo: sent; nccl: enqueued on the GPU)."""
        names, tied = _untie(state_dict)
        specs = [(n, tuple(state_dict[n].shape), state_dict[n].dtype) for n in names]
        buckets = plan_buckets(specs, self.bucket_bytes)
        header = {
            "version": version,
            "tied": tied,
            "buckets": [
                [str(b.dtype).removeprefix("torch."), [[n, list(s)] for n, s in b.tensors]]
                for b in buckets
            ],
        }
        data = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        device = self.group.device
        self.group.broadcast(torch.tensor([len(data)], device=device), "the header's length")
        self.group.broadcast(data.to(device), "the header")
        raw = _buffer(buckets, device)
        with torch.no_grad():
            for i, bucket in enumerate(buckets):
                buffer = raw[: bucket.nbytes].view(bucket.dtype)
                for name, view in bucket.views(buffer).items():
                    view.copy_(state_dict[name])
                self.group.broadcast(buffer, f"bucket {i + 1}/{len(buckets)} of version {version}")


class WeightReceiver:
    """Receives state dicts on a rank >= 1 of `group`, bucket by bucket."""

    def __init__(self, group: WeightSyncGroup) -> None:
        if group.rank == 0:
            raise ValueError("a WeightReceiver runs on ranks 1.. of the group; rank 0 sends")
        self.group = group

    def receive(self, load: Callable[[dict[str, torch.Tensor]], None]) -> int:
        """Receive one `send`, calling `load(tensors)` once per bucket; return its version.

        `tensors` are views into a buffer that the next bucket overwrites: `load` copies
        them (as an engine replica does) and keeps no reference.
        """
        device = self.group.device
        length = torch.zeros(1, dtype=torch.int64, device=device)
        self.group.broadcast(length, "the header's length")
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        self.group.broadcast(data, "the header")
        header = json.loads(data.cpu().numpy().tobytes())
        buckets = [
            Bucket(_dtype(dtype), tuple((n, tuple(s)) for n, s in tensors))
            for dtype, tensors in header["buckets"]
        ]
        aliases: dict[str, list[str]] = {}
        for alias, source in header["tied"].items():
            aliases.setdefault(source, []).append(alias)
        version = header["version"]
        raw = _buffer(buckets, device)
        for i, bucket in enumerate(buckets):
            buffer = raw[: bucket.nbytes].view(bucket.dtype)
            self.group.broadcast(buffer, f"bucket {i + 1}/{len(buckets)} of version {version}")
            tensors = bucket.views(buffer)
            for source in list(tensors):
                for alias in aliases.get(source, []):
                    tensors[alias] = tensors[source]
            load(tensors)
        return version


def _untie(state_dict: dict[str, torch.Tensor]) -> tuple[list[str], dict[str, str]]:
    """The names to send, in order, and {alias: source} for a name that is the same
    tensor (same storage, offset, shape, strides, dtype) as an earlier one."""
    names: list[str] = []
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state_dict.items():
        key = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tensor.shape,
            tensor.stride(),
            tensor.dtype,
        )
        if key in seen and tensor.numel() > 0:
            tied[name] = seen[key]
        else:
            seen.setdefault(key, name)
            names.append(name)
    return names, tied


def _buffer(buckets: list[Bucket], device: torch.device) -> torch.Tensor:
    """Raw bytes for the largest bucket, reused by every bucket (one in flight)."""
    return torch.empty(
        max((b.nbytes for b in buckets), default=0), dtype=torch.uint8, device=device
    )


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"weight sync header names dtype {name!r}, which torch lacks")
    return dtype
