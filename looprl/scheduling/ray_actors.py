"""The Ray scheduler's actors: an engine replica and a trainer rank, each in its own
process, started by the driver (scheduling/ray.py) with the start-up `Setup` it
resolved (and, for actors Ray gives a GPU, decided for that GPU): neither decides a
device or a precision, nor resolves the model again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray
import torch
import torch.distributed as dist

from looprl.engines.servers.server_engine import ServerEngine
from looprl.runtime import release_free_memory
from looprl.scheduling.parts import build_trainer
from looprl.scheduling.ranks import join_group, use_interface_of
from looprl.startup import Setup
from looprl.training.batch import TrainBatch
from looprl.types import Generation, LoraAdapter, SamplingParams


def _actor_setup(setup: Setup, threads: int) -> Setup:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("looprl").setLevel(setup.cfg.run.log_level)
    use_interface_of(ray.util.get_node_ip_address())  # gloo reaches peers on other nodes
    if threads > 0:
        torch.set_num_threads(threads)
    return setup


class EngineReplica:
    """One engine (local, or a vLLM / SGLang server it launches) in a Ray actor.

    An async actor: concurrent `generate` calls reach the engine together and batch.
    `release_memory`: free the server's GPU memory while paused (collocated placement;
    the local engine keeps its memory)."""

    def __init__(self, setup: Setup, index: int, threads: int, release_memory: bool = False):
        self.setup = _actor_setup(setup, threads)
        self.cfg = setup.cfg
        self.index = index
        self.release_memory = release_memory
        self.engine = None
        self.server: ServerEngine | None = None  # what pause releases, when collocated
        self.receiver = None

    async def start(self) -> dict[str, Any]:
        from looprl.diagnostics.watchdog import register
        from looprl.engines.launch import start_engine

        setup = self.setup
        model = setup.model.load().to(setup.device)  # the engine keeps its own copy
        paths = setup.paths.replica(self.index)
        self.engine = await start_engine(setup, model, paths)
        if self.release_memory:  # the driver asks it of vLLM / SGLang servers only
            self.server = self.engine
        register(setup.paths.root, f"engine-{self.index}", role="engine", rank=None)
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address()}

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        return await self.engine.generate(prompt_ids, sampling)

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        await self.engine.update_weights(state_dict, version)
        return self.engine.version

    async def update_adapter(self, adapter: LoraAdapter, version: int) -> int:
        await self.engine.update_adapter(adapter, version)
        return self.engine.version

    async def pause(self) -> None:
        """Pause; collocated on a trainer rank's GPUs, a vLLM/SGLang server also frees its
        weights and KV cache until the next weight load or resume."""
        await self.engine.pause()
        if self.server is not None:
            await self.server.release_memory()

    async def resume(self) -> None:
        await self.engine.resume()

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.stop()

    async def join_weight_group(self, host: str, port: int, rank: int, world: int) -> None:
        from looprl.scheduling.weight_broadcast import WeightReceiver, weight_sync_group

        backend = "nccl" if self.setup.device.type == "cuda" else "gloo"
        timeout = self.cfg.diagnostics.collective_timeout_s
        group = await asyncio.to_thread(
            weight_sync_group, host, port, rank, world, backend, timeout
        )
        self.receiver = WeightReceiver(group)

    async def receive_weights(self) -> int:
        """Receive the buckets rank 0 broadcasts, then load them into the engine. Each
        bucket arrives in one reused buffer, hence the copies."""
        received: dict[str, torch.Tensor] = {}

        def keep(bucket: dict[str, torch.Tensor]) -> None:
            received.update({name: t.clone() for name, t in bucket.items()})

        version = await asyncio.to_thread(self.receiver.receive, keep)
        await self.engine.update_weights(received, version)
        return version


class TrainerRank:
    """One data-parallel trainer rank in a Ray actor (calls run one at a time)."""

    def __init__(self, setup: Setup, rank: int, world_size: int, threads: int):
        self.setup = _actor_setup(setup, threads)
        self.cfg = setup.cfg
        self.rank, self.world_size = rank, world_size
        self.store: dist.TCPStore | None = None

    def open_store(self) -> tuple[str, int]:
        """Rank 0: host the TCPStore the ranks meet at; returns its address."""
        from datetime import timedelta

        timeout = timedelta(seconds=self.cfg.diagnostics.collective_timeout_s)
        host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(
            host, 0, self.world_size, is_master=True, wait_for_workers=False, timeout=timeout
        )
        return host, self.store.port

    def setup(self, host: str, port: int) -> dict[str, Any]:
        """Join the group, start the hang watchdog, load the policy and build the trainer."""
        from datetime import timedelta

        from looprl.diagnostics.watchdog import HangWatchdog
        from looprl.training.distributed import DataParallelTrainer

        cfg = self.cfg
        timeout_s = cfg.diagnostics.collective_timeout_s
        device = self.setup.device
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = self.store or dist.TCPStore(
            host, port, self.world_size, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
        join_group(store, self.rank, self.world_size, backend, device, timeout_s)
        self.watchdog = HangWatchdog(
            self.setup.paths.root, f"rank-{self.rank}", cfg.diagnostics, role="rank", rank=self.rank
        ).start()
        torch.manual_seed(cfg.run.seed)
        policy = self.setup.model.load(cfg.model.dtype).to(device)
        self.trainer = build_trainer(self.setup, policy, DataParallelTrainer)
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), "backend": backend}

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        stats = self.trainer.train_step(batch)
        self.watchdog.beat()
        return stats

    def step_logprobs(self) -> torch.Tensor | None:
        return self.trainer.step_logprobs

    def weights(self) -> list[ray.ObjectRef] | None:
        """The full weights, or with model.lora the adapter (a collective: every rank calls
        it). Rank 0 puts them in the object store once and returns [ref], which replicas
        fetch without the driver."""
        adapter = self.trainer.adapter_for_engine()
        return self._put(self.trainer.state_dict_for_engine() if adapter is None else adapter)

    def current_weights(self) -> tuple[list[ray.ObjectRef] | None, int]:
        """`weights()` and their version, read together (for a restarted replica)."""
        return self.weights(), self.trainer.version

    def _put(self, state: dict[str, Any]) -> list[ray.ObjectRef] | None:
        """Rank 0: `state` into the object store, as [ref]; then this process's copy is
        dropped and its memory given back (it is rebuilt at the next call)."""
        ref = [ray.put(state)] if self.rank == 0 else None
        del state
        release_free_memory()
        return ref

    def join_weight_group(self, host: str, port: int, world: int) -> None:
        from looprl.scheduling.weight_broadcast import WeightSender, weight_sync_group

        backend = "nccl" if self.setup.device.type == "cuda" else "gloo"
        timeout = self.cfg.diagnostics.collective_timeout_s
        group = weight_sync_group(host, port, 0, world, backend, timeout)
        self.sender = WeightSender(group, self.cfg.scheduler.bucket_mb << 20)

    def weight_group_address(self) -> tuple[str, int]:
        from looprl.engines.servers.process import free_port

        return ray.util.get_node_ip_address(), free_port()

    def broadcast_weights(self) -> None:
        """Every rank gathers the full weights; rank 0 broadcasts them to the replicas."""
        state = self.trainer.state_dict_for_engine()
        if self.rank == 0:
            self.sender.send(state, self.trainer.version)

    def state_dict(self) -> list[ray.ObjectRef] | None:
        """Model, optimizer, schedule and version for a checkpoint (a collective)."""
        return self._put(self.trainer.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)

    def stop(self) -> None:
        self.watchdog.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
