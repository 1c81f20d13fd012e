"""The Ray scheduler: engine replicas and trainer ranks as Ray actors.

`start_ray_actors(cfg, workflow)` joins the cluster at `scheduler.ray_address` (or starts a
local Ray for this run), plans where every actor goes (scheduling/placement.py: the
allocation string or the explicit fields, devices left idle named in a warning), and
starts one `EngineReplica` actor per engine replica and one `TrainerRank` actor per
trainer rank. This process, the driver, keeps the gateway, the rollout controller and
the loop: the gateway serves from an `EnginePool` of `RayEngine` handles (least
outstanding tokens, sessions sticky, a dead replica's requests retried on another),
and the loop trains through `RankGroup`, a `TrainerHandle` over the ranks. A replica
that dies is restarted by the pool (engine.max_restarts, weight_sync=memory): a new
actor in its place, loaded with the trainer's current weights and their version.

Trainer ranks form one torch.distributed group (gloo on CPU, NCCL on GPU) through a
TCPStore hosted by rank 0, with `diagnostics.collective_timeout_s` as the collective
timeout; each runs a `DataParallelTrainer` (FSDP2 when there is more than one) and a
hang watchdog registered as `rank N`. Every rank gets the same batch (through Ray's
object store) and takes its share. A rank that fails stops every rank at once, and the
error raised in the driver is that rank's own traceback.

Weights reach the replicas (`scheduler.weight_sync`) through Ray's object store
(`memory`: rank 0 puts the full state dict once, each replica fetches it; on one node
that is shared memory), or by `broadcast` from rank 0 over a separate process group in
buckets (weight_broadcast.py: NCCL on GPU, gloo on CPU; local engines). A vLLM or
SGLang replica writes what it receives as a weight folder under its own
`<run_dir>/engines/replica-N/` and reloads its server from it, as it does locally.
Versions travel with the weights.

On a cluster, `run.fileroot` must be on storage every node sees (checkpoints and
weight folders are written by actors on other nodes).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.exceptions import OutOfMemoryError, RayActorError, RayError, RayTaskError

from looprl import precision
from looprl.config import Config
from looprl.engines.base import EngineUnavailable
from looprl.engines.pool import EnginePool
from looprl.engines.servers.reloadable import ServerEngine
from looprl.models import base_model_path, load_model, load_tokenizer
from looprl.runtime import release_free_memory
from looprl.scheduling.parts import Parts, build_trainer, gateway_and_controller
from looprl.scheduling.placement import Plan, cluster_nodes, resolve
from looprl.scheduling.ranks import RankFailed, join_group
from looprl.scheduling.single_process import save_policy
from looprl.training import lora
from looprl.training.batch import TrainBatch
from looprl.types import Generation, LoraAdapter, SamplingParams
from looprl.workflows.protocol import Workflow

log = logging.getLogger(__name__)

BLAME_WINDOW_S = 3.0  # after a rank fails, how long the others' failures may take to arrive
COLLOCATED_MEMORY_FRACTION = 0.45  # of a GPU, for a vLLM/SGLang server beside a trainer rank


# ---- in the actors ------------------------------------------------------------------


def _actor_setup(cfg_data: dict[str, Any], threads: int) -> Config:
    cfg = Config.model_validate(cfg_data)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("looprl").setLevel(cfg.run.log_level)
    if threads > 0:
        torch.set_num_threads(threads)
    return cfg


def _device() -> torch.device:
    """The GPU Ray gave this actor (it sets CUDA_VISIBLE_DEVICES), else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


class EngineReplica:
    """One engine (local, or a vLLM / SGLang server it launches) in a Ray actor.

    An async actor: concurrent `generate` calls reach the engine together and batch.
    `release_memory`: free the server's GPU memory while paused (collocated placement;
    the local engine keeps its memory)."""

    def __init__(
        self, cfg_data: dict[str, Any], index: int, threads: int, release_memory: bool = False
    ):
        self.cfg = _actor_setup(cfg_data, threads)
        self.index = index
        self.release_memory = release_memory
        self.engine = None
        self.server: ServerEngine | None = None  # what pause releases, when collocated
        self.receiver = None

    async def start(self) -> dict[str, Any]:
        from looprl.diagnostics.watchdog import register
        from looprl.engines.launch import start_engine

        cfg = self.cfg
        run_dir = cfg.run_dir / "engines" / f"replica-{self.index}"
        tokenizer = load_tokenizer(cfg.model.path)
        model = load_model(cfg.model.path).to(_device())  # the engine keeps its own copy
        precision.choose(cfg, _device())  # logs this replica's decision
        self.engine = await start_engine(cfg, model, tokenizer, run_dir)
        if self.release_memory:  # only server engines are collocated to release (see below)
            assert isinstance(self.engine, ServerEngine), type(self.engine)
            self.server = self.engine
        register(cfg.run_dir, f"engine-{self.index}", role="engine", rank=None)
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

        backend = "nccl" if torch.cuda.is_available() else "gloo"
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

    def __init__(self, cfg_data: dict[str, Any], rank: int, world_size: int, threads: int):
        self.cfg = _actor_setup(cfg_data, threads)
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
        device = _device()
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = self.store or dist.TCPStore(
            host, port, self.world_size, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
        join_group(store, self.rank, self.world_size, backend, device, timeout_s)
        self.watchdog = HangWatchdog(
            cfg.run_dir, f"rank-{self.rank}", cfg.diagnostics, role="rank", rank=self.rank
        ).start()
        torch.manual_seed(cfg.run.seed)
        if self.rank == 0:
            precision.choose(cfg, device)  # logs the ranks' decision
        policy = load_model(cfg.model.path, cfg.model.dtype).to(device)
        self.trainer = build_trainer(cfg, policy, DataParallelTrainer)
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

        backend = "nccl" if torch.cuda.is_available() else "gloo"
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


# ---- in the driver ------------------------------------------------------------------


class RayEngine:
    """The Engine protocol over one `EngineReplica` actor. A replica that died (its
    process killed, its node lost) raises EngineUnavailable, which the pool acts on; an
    error the engine raised arrives as itself (e.g. EngineError for a bad prompt).

    `new_actor` makes another actor like this one (same placement and options), for
    `restart`; `current_weights` gives the trainer's weights (an ObjectRef) and their
    version to load into it."""

    def __init__(
        self,
        actor,
        name: str,
        info: dict[str, Any],
        *,
        new_actor: Callable[[], Any],
        current_weights: Callable[[], Awaitable[tuple[ray.ObjectRef, int]]],
        adapters: bool = False,
    ):
        self.actor, self.name, self.info = actor, name, info
        self._new_actor, self._current_weights = new_actor, current_weights
        self._adapters = adapters  # current_weights gives a LoRA adapter (model.lora)
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, session: str | None = None
    ) -> Generation:
        return await self._call(self.actor.generate.remote(prompt_ids, sampling))

    async def update_weights(self, state_dict, version: int) -> None:
        """`state_dict`: a dict of tensors, or a Ray ObjectRef of one (fetched by the
        replica itself, not through this process)."""
        self._version = await self._call(self.actor.update_weights.remote(state_dict, version))

    async def update_adapter(self, adapter, version: int) -> None:
        """`adapter`: a LoraAdapter, or a Ray ObjectRef of one."""
        self._version = await self._call(self.actor.update_adapter.remote(adapter, version))

    async def receive_weights(self) -> None:
        self._version = await self._call(self.actor.receive_weights.remote())

    async def pause(self) -> None:
        await self._call(self.actor.pause.remote())

    async def resume(self) -> None:
        await self._call(self.actor.resume.remote())

    async def stop(self) -> None:
        with suppress(EngineUnavailable, TimeoutError):  # dead or stuck: killed below
            await asyncio.wait_for(self._call(self.actor.stop.remote()), timeout=60)
        ray.kill(self.actor)

    async def restart(self) -> None:
        """A new actor in place of this one, after what is left of the old one (a server
        it launched, the actor) is stopped; started, then loaded with the trainer's
        current weights and their version."""
        dead = self.info
        await self.stop()
        self.actor = self._new_actor()
        self.info = await self._call(self.actor.start.remote())
        state_ref, version = await self._current_weights()
        load = self.actor.update_adapter if self._adapters else self.actor.update_weights
        self._version = await self._call(load.remote(state_ref, version))
        log.info(
            "Engine %s: a new actor (pid %s on %s) replaces the one that died (pid %s on "
            "%s), loaded with the trainer's weights of version %d",
            self.name,
            self.info["pid"],
            self.info["node"],
            dead.get("pid"),
            dead.get("node"),
            self._version,
        )

    async def _call(self, ref: Awaitable):
        try:
            return await ref
        except RayTaskError as e:
            raise e.as_instanceof_cause() from None
        except (RayActorError, OutOfMemoryError) as e:
            where = f"pid {self.info.get('pid')} on {self.info.get('node')}"
            why = str(e).strip().splitlines()[0]  # Ray's first line; the rest is its advice
            if isinstance(e, OutOfMemoryError):
                why = f"Ray's memory monitor killed it, the node being out of memory ({why})"
            raise EngineUnavailable(f"engine {self.name} ({where}) died: {why}") from e


class RankGroup:
    """The loop's `TrainerHandle` over the trainer rank actors, feeding the replicas of
    `pool` (set once the replicas exist: they start after the ranks)."""

    def __init__(self, cfg: Config, ranks: list, weight_sync: str):
        self.cfg, self.ranks, self.weight_sync = cfg, ranks, weight_sync
        self.pool: EnginePool | None = None
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    async def train_step(self, batch: TrainBatch) -> dict[str, float]:
        ref = ray.put(batch)
        stats = await self._all("train_step", ref)
        self._version += 1
        return stats[0]

    async def step_logprobs(self) -> torch.Tensor | None:
        return (await self._all("step_logprobs"))[0]  # summed over ranks: whole on each

    async def push_weights(self) -> None:
        if self.weight_sync == "broadcast":
            replicas: list[RayEngine] = self.pool.healthy_engines()
            await asyncio.gather(
                self._all("broadcast_weights"), *(r.receive_weights() for r in replicas)
            )
            return
        (state_ref,) = (await self._all("weights"))[0]
        if self.cfg.model.lora.enabled:
            await self.pool.update_adapter(state_ref, self._version)
        else:
            await self.pool.update_weights(state_ref, self._version)

    async def current_weights(self) -> tuple[ray.ObjectRef, int]:
        """The weights now, in the object store, and their version, both read on the
        ranks: exact even while a step is under way (ranks take calls in order)."""
        (state_ref,), version = (await self._all("current_weights"))[0]
        return state_ref, version

    async def state_dict(self) -> dict[str, Any]:
        (state_ref,) = (await self._all("state_dict"))[0]
        return await state_ref

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        await self._all("load_state_dict", ray.put(state))
        self._version = state["version"]

    async def save_model(self, tokenizer, out: Path) -> Path:
        (state_ref,) = (await self._all("weights"))[0]
        lora_cfg = self.cfg.model.lora
        if lora_cfg.enabled:
            base = str(base_model_path(self.cfg.model.path))
            return lora.save_outputs(
                await state_ref, base, tokenizer, out, merged=lora_cfg.save_merged
            )
        model = load_model(self.cfg.model.path, self.cfg.model.dtype)  # with its generation config
        model.load_state_dict(await state_ref)
        return save_policy(model, tokenizer, out)

    async def stop(self) -> None:
        with suppress(RankFailed, TimeoutError):  # a rank that fails here is killed below
            await asyncio.wait_for(self._all("stop"), timeout=30)
        for actor in self.ranks:
            ray.kill(actor)

    async def _all(self, method: str, *args) -> list[Any]:
        """Call `method` on every rank; a failure kills every rank and raises RankFailed
        naming the cause, not a peer's collective error that followed it.

        When a rank dies, its peers' collectives can fail within milliseconds
        ("Connection closed by peer"), and Ray may report those before the death. So
        after the first failure the others get `BLAME_WINDOW_S` to arrive; a rank that
        died is blamed before one that raised, then the lowest rank."""
        calls = {
            asyncio.ensure_future(getattr(actor, method).remote(*args)): rank
            for rank, actor in enumerate(self.ranks)
        }
        pending = set(calls)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            if any(f.exception() is not None for f in done):
                if pending:
                    more, pending = await asyncio.wait(pending, timeout=BLAME_WINDOW_S)
                    done |= more
                failed = [f for f in done if f.exception() is not None]
                first = min(
                    failed,
                    key=lambda f: (isinstance(f.exception(), RayTaskError), calls[f]),
                )
                for actor in self.ranks:
                    ray.kill(actor)
                for f in pending:
                    f.cancel()
                raise _rank_failed(calls[first], len(self.ranks), first.exception())
        return [f.result() for f in sorted(calls, key=calls.get)]


def _rank_failed(rank: int, world: int, error: BaseException) -> RankFailed:
    if isinstance(error, RayTaskError):
        message = f"trainer rank {rank} of {world} raised; every rank was stopped:\n\n{error}"
        return RankFailed(message, rank, {}, str(error))
    message = (
        f"trainer rank {rank} of {world} died ({error}); every rank was stopped. A process "
        "killed by SIGKILL is often the kernel's out-of-memory killer (see `dmesg`)"
    )
    return RankFailed(message, rank, {}, None)


@asynccontextmanager
async def start_ray_actors(cfg: Config, workflow: Workflow) -> AsyncIterator[Parts]:
    """Engine replicas and trainer ranks as Ray actors; gateway and controller here."""
    weight_sync = "broadcast" if cfg.scheduler.weight_sync == "broadcast" else "memory"
    started = not ray.is_initialized()
    if started:
        address = cfg.scheduler.ray_address
        log.info("Starting Ray" if address is None else f"Joining the Ray cluster at {address}")
        ray.init(
            address=address,
            num_cpus=os.cpu_count() if address is None else None,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    engines: list[RayEngine] = []
    pool: EnginePool | None = None
    group: RankGroup | None = None
    try:
        plan = resolve(cfg, cluster_nodes())
        for warning in plan.warnings:
            log.warning("%s", warning)
        log.info("%s", plan.describe())
        group = await _start_ranks(cfg, plan, weight_sync)
        engines = await _start_engines(cfg, plan, group)
        max_restarts = cfg.engine.max_restarts
        if weight_sync == "broadcast":
            await _join_weight_group(group, engines)
            if max_restarts:
                log.info(
                    "engine.max_restarts=%d does not apply with scheduler.weight_sync="
                    "broadcast: a new replica actor cannot join the broadcast group, so a "
                    "replica that dies stays down (weight_sync=memory restarts it)",
                    max_restarts,
                )
            max_restarts = 0
        pool = EnginePool(engines, names=[e.name for e in engines], max_restarts=max_restarts)
        group.pool = pool
        tokenizer = load_tokenizer(cfg.model.path)
        async with gateway_and_controller(
            cfg, pool, tokenizer, workflow, engine_health=pool.stats
        ) as parts:
            parts.trainer = group
            yield parts
    finally:
        # The pool also cancels a replica's restart under way.
        stops = [pool.stop()] if pool is not None else [e.stop() for e in engines]
        await asyncio.gather(*stops, return_exceptions=True)
        if group is not None:
            await group.stop()
        if started:
            ray.shutdown()


async def _start_ranks(cfg: Config, plan: Plan, weight_sync: str) -> RankGroup:
    data = cfg.model_dump(mode="json")
    world = len(plan.trainers)
    actors = [
        ray.remote(TrainerRank)
        .options(num_cpus=0, **bundle.ray_options())
        .remote(data, rank, world, _threads(plan, plan.trainers, bundle))
        for rank, bundle in enumerate(plan.trainers)
    ]
    group = RankGroup(cfg, actors, weight_sync)
    log.info("Starting %d trainer rank(s)", world)
    try:
        host, port = await actors[0].open_store.remote()
        infos = await group._all("setup", host, port)
    except RayError as e:
        for actor in actors:
            ray.kill(actor)
        raise RankFailed(f"trainer ranks could not start: {e}", 0, {}, None) from e
    for rank, info in enumerate(infos):
        log.info(
            "Trainer rank %d: pid %s on %s (%s)", rank, info["pid"], info["node"], info["backend"]
        )
    return group


async def _start_engines(cfg: Config, plan: Plan, group: RankGroup) -> list[RayEngine]:
    engine_cfg = cfg.engine.model_copy(update={"tensor_parallel_size": plan.tensor_parallel_size})
    collocated_gpus = plan.placement == "collocated" and any(b.gpu_ids for b in plan.engines)
    if collocated_gpus and engine_cfg.type != "local" and engine_cfg.gpu_memory_fraction is None:
        # A server sizes its KV cache to ~90% of the GPU by default: none left for the rank.
        engine_cfg.gpu_memory_fraction = COLLOCATED_MEMORY_FRACTION
        log.info(
            "Collocated engines get engine.gpu_memory_fraction=%.2f of each GPU; the rest is "
            "the trainer rank's (set engine.gpu_memory_fraction to change it)",
            COLLOCATED_MEMORY_FRACTION,
        )
    if collocated_gpus and engine_cfg.type != "local":
        # The server frees its weights and KV cache while the trainer steps (see
        # EngineReplica.pause); it must be started able to.
        flag = "--enable-sleep-mode" if engine_cfg.type == "vllm" else "--enable-memory-saver"
        if flag not in engine_cfg.server_args:
            engine_cfg.server_args = [*engine_cfg.server_args, flag]
    data = cfg.model_copy(update={"engine": engine_cfg}).model_dump(mode="json")

    def new_actor(index: int):
        bundle = plan.engines[index]
        return (
            ray.remote(EngineReplica)
            .options(num_cpus=0, max_concurrency=1000, **bundle.ray_options())
            .remote(data, index, _threads(plan, plan.engines, bundle), collocated_gpus)
        )

    actors = [new_actor(index) for index in range(len(plan.engines))]
    log.info("Starting %d engine replica(s) (%s)", len(actors), cfg.engine.type)
    engines = []
    try:
        infos = await asyncio.gather(*(actor.start.remote() for actor in actors))
    except RayError:
        for actor in actors:
            ray.kill(actor)
        raise
    for index, (actor, info) in enumerate(zip(actors, infos, strict=True)):
        name = f"replica-{index}"
        log.info("Engine %s: pid %s on %s", name, info["pid"], info["node"])
        engines.append(
            RayEngine(
                actor,
                name,
                info,
                new_actor=functools.partial(new_actor, index),
                current_weights=group.current_weights,
                adapters=cfg.model.lora.enabled,
            )
        )
    return engines


def _threads(plan: Plan, bundles, bundle) -> int:
    """Torch threads for an actor: its node's CPUs shared by the actors of its kind there
    (engines decode at once; ranks step at once; the two take turns)."""
    cpus = next((n.cpus for n in plan.nodes if n.ip == bundle.node_ip), 1)
    peers = sum(b.node_ip == bundle.node_ip for b in bundles)
    return max(1, cpus // peers)


async def _join_weight_group(group: RankGroup, engines: list[RayEngine]) -> None:
    world = 1 + len(engines)
    host, port = await group.ranks[0].weight_group_address.remote()
    await asyncio.gather(
        group.ranks[0].join_weight_group.remote(host, port, world),
        *(
            e.actor.join_weight_group.remote(host, port, i + 1, world)
            for i, e in enumerate(engines)
        ),
    )
