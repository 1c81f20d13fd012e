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
error raised in the driver is that rank's own traceback, or, for a rank that died, its
pid and node (and whether Ray has lost that node).

Before anything is placed, every alive node must answer at the address it announced
(scheduling/reachability.py): one that does not would leave its actors waiting forever,
so the run stops at once naming it. Once the actors run, `<run_dir>/placement.json`
says where each did (kind, index, node, pid; a rank's backend), as they reported it.

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
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import OutOfMemoryError, RayActorError, RayError, RayTaskError

from looprl import startup
from looprl.engines.base import EngineUnavailable
from looprl.engines.pool import EnginePool
from looprl.runs.atomic import atomic_write_text
from looprl.scheduling.parts import Parts, gateway_and_controller, pause_engine_while_training
from looprl.scheduling.placement import Plan, cluster_nodes, resolve
from looprl.scheduling.ranks import RankFailed
from looprl.scheduling.ray_actors import EngineReplica, TrainerRank
from looprl.scheduling.reachability import check_cluster
from looprl.startup import Setup
from looprl.training import lora
from looprl.training.batch import TrainBatch
from looprl.training.policy_folder import save_policy
from looprl.types import Generation, SamplingParams
from looprl.workflows.protocol import Workflow

log = logging.getLogger(__name__)

BLAME_WINDOW_S = 3.0  # after a rank fails, how long the others' failures may take to arrive
NODE_DEATH_WINDOW_S = 20.0  # after a rank died, how long its node's death may take to show
COLLOCATED_MEMORY_FRACTION = 0.45  # of a GPU, for a vLLM/SGLang server beside a trainer rank


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

    def __init__(self, setup: Setup, ranks: list, weight_sync: str):
        self.setup, self.cfg = setup, setup.cfg
        self.ranks, self.weight_sync = ranks, weight_sync
        self.infos: list[dict[str, Any]] = [{} for _ in ranks]  # pid, node: set once started
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
            base = str(self.setup.model.folder)
            return lora.save_outputs(
                await state_ref, base, tokenizer, out, merged=lora_cfg.save_merged
            )
        model = self.setup.model.load(self.cfg.model.dtype)  # with its generation config
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
                rank, error = calls[first], first.exception()
                node = self.infos[rank].get("node")
                lost = not isinstance(error, RayTaskError) and node and not await _alive(node)
                raise _rank_failed(rank, len(self.ranks), error, self.infos[rank], lost)
        return [f.result() for f in sorted(calls, key=calls.get)]


def _rank_failed(
    rank: int, world: int, error: BaseException, info: dict[str, Any], node_lost: bool
) -> RankFailed:
    if isinstance(error, RayTaskError):
        message = f"trainer rank {rank} of {world} raised; every rank was stopped:\n\n{error}"
        return RankFailed(message, rank, {}, str(error))
    node = info.get("node")
    where = "" if node is None else f" (pid {info['pid']} on node {node})"
    if node is None:  # it died starting
        why = "A process killed by SIGKILL is often the kernel's out-of-memory killer"
    elif node_lost:
        why = (
            f"Ray lost node {node}: the machine, its network or its raylet went away; the "
            "run can resume from its last checkpoint once the cluster is whole again"
        )
    else:
        why = (
            f"Its node {node} is still in the cluster: a process killed by SIGKILL is often "
            f"the kernel's out-of-memory killer (see `dmesg` on {node})"
        )
    message = f"trainer rank {rank} of {world}{where} died ({error}); every rank was stopped. {why}"
    return RankFailed(message, rank, {}, None)


async def _alive(ip: str, wait_s: float = NODE_DEATH_WINDOW_S) -> bool:
    """Whether Ray still lists node `ip` as alive after `wait_s` (a node whose processes
    were all killed is marked dead some seconds after its actors are seen dead)."""
    if ip == ray.util.get_node_ip_address():
        return True  # this process's own node
    deadline = time.monotonic() + wait_s
    while True:
        alive = any(n["Alive"] for n in ray.nodes() if n["NodeManagerAddress"] == ip)
        if not alive or time.monotonic() >= deadline:
            return alive
        await asyncio.sleep(0.5)


def init_ray(address: str | None) -> None:
    """Connect this process to Ray as a run does: a local Ray on all this machine's CPUs
    (address None), or the cluster at `address`."""
    log.info("Starting Ray" if address is None else f"Joining the Ray cluster at {address}")
    ray.init(
        address=address,
        num_cpus=os.cpu_count() if address is None else None,
        include_dashboard=False,
        logging_level=logging.WARNING,
    )


@asynccontextmanager
async def start_ray_actors(setup: Setup, workflow: Workflow) -> AsyncIterator[Parts]:
    """Engine replicas and trainer ranks as Ray actors; gateway and controller here."""
    cfg = setup.cfg
    weight_sync = "broadcast" if cfg.scheduler.weight_sync == "broadcast" else "memory"
    started = not ray.is_initialized()
    if started:
        init_ray(cfg.scheduler.ray_address)
    engines: list[RayEngine] = []
    pool: EnginePool | None = None
    group: RankGroup | None = None
    try:
        check_cluster(cfg.scheduler.ray_address)
        plan = resolve(cfg, cluster_nodes())
        for warning in plan.warnings:
            log.warning("%s", warning)
        log.info("%s", plan.describe())
        if plan.uses_gpus:
            setup = await startup.on_ray_gpu(setup)
        group = await _start_ranks(setup, plan, weight_sync)
        engines = await _start_engines(setup, plan, group)
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
        _write_placement(setup, plan, group, engines)
        apart = plan.placement == "disaggregated" and plan.uses_gpus
        pause = pause_engine_while_training(
            cfg, "Ray replicas on GPUs of their own (disaggregated)" if apart else None
        )
        async with gateway_and_controller(
            setup,
            pool,
            setup.model.tokenizer,
            workflow,
            engine_health=pool.stats,
            pause_engine=pause,
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


async def _start_ranks(setup: Setup, plan: Plan, weight_sync: str) -> RankGroup:
    world = len(plan.trainers)
    actors = [
        ray.remote(TrainerRank)
        .options(num_cpus=0, **bundle.ray_options())
        .remote(setup, rank, world, _threads(plan, plan.trainers, bundle))
        for rank, bundle in enumerate(plan.trainers)
    ]
    group = RankGroup(setup, actors, weight_sync)
    log.info("Starting %d trainer rank(s)", world)
    try:
        host, port = await actors[0].open_store.remote()
        infos = await group._all("setup", host, port)
    except RayError as e:
        for actor in actors:
            ray.kill(actor)
        raise RankFailed(f"trainer ranks could not start: {e}", 0, {}, None) from e
    group.infos = infos
    for rank, info in enumerate(infos):
        log.info(
            "Trainer rank %d: pid %s on %s (%s)", rank, info["pid"], info["node"], info["backend"]
        )
    return group


async def _start_engines(setup: Setup, plan: Plan, group: RankGroup) -> list[RayEngine]:
    cfg = setup.cfg
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
    # A server collocated with a trainer rank on its GPUs frees them while the rank steps
    # (EngineReplica.pause); a local engine keeps its memory.
    release_memory = collocated_gpus and engine_cfg.type != "local"
    if release_memory:
        # The server frees its weights and KV cache while the trainer steps (see
        # EngineReplica.pause); it must be started able to.
        flag = "--enable-sleep-mode" if engine_cfg.type == "vllm" else "--enable-memory-saver"
        if flag not in engine_cfg.server_args:
            engine_cfg.server_args = [*engine_cfg.server_args, flag]
    setup = replace(setup, cfg=cfg.model_copy(update={"engine": engine_cfg}))

    def new_actor(index: int):
        bundle = plan.engines[index]
        return (
            ray.remote(EngineReplica)
            .options(num_cpus=0, max_concurrency=1000, **bundle.ray_options())
            .remote(setup, index, _threads(plan, plan.engines, bundle), release_memory)
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


def _write_placement(setup: Setup, plan: Plan, group: RankGroup, engines: list[RayEngine]):
    """`<run_dir>/placement.json`: where each actor runs, as it reported it (its node's
    IP and its pid), beside where the plan put it: for a user checking that every node of
    the cluster got work. Written once at start; a replica restarted later is logged."""
    actors = [
        {"kind": "trainer_rank", "index": rank, **info, "planned_node": bundle.node_ip}
        for rank, (info, bundle) in enumerate(zip(group.infos, plan.trainers, strict=True))
    ]
    actors += [
        {"kind": "engine_replica", "index": i, **e.info, "planned_node": bundle.node_ip}
        for i, (e, bundle) in enumerate(zip(engines, plan.engines, strict=True))
    ]
    report = {
        "ray_address": setup.cfg.scheduler.ray_address,
        "placement": plan.placement,
        "nodes": [{"ip": n.ip, "cpus": n.cpus, "gpus": n.gpus} for n in plan.nodes],
        "actors": actors,
    }
    atomic_write_text(setup.paths.placement, json.dumps(report, indent=1) + "\n")


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
