"""Placement planning: allocation strings, and engine replicas and trainer ranks on nodes."""

from __future__ import annotations

import os

import pytest

from looprl import runtime
from looprl.config import Config, ConfigError
from looprl.scheduling.placement import Bundle, Node, cluster_nodes, parse_allocation, resolve

ONE_NODE = [Node("10.0.0.1", 8)]
TWO_NODES = [Node("10.0.0.1", 4), Node("10.0.0.2", 4)]


def config(engine: str = "vllm", tp: int = 1, **scheduler) -> Config:
    engine_cfg = {"type": engine} | ({"tensor_parallel_size": tp} if tp > 1 else {})
    return Config.model_validate({"engine": engine_cfg, "scheduler": {"type": "ray", **scheduler}})


def where(bundles) -> list[tuple[str, tuple[int, ...]]]:
    return [(b.node_ip, b.gpu_ids) for b in bundles]


def test_disaggregated_on_eight_gpus_trainer_first_then_engines(monkeypatch):
    monkeypatch.delenv(runtime.FORCE_CPU_VARIABLE, raising=False)
    plan = resolve(config(allocation="vllm:d6+fsdp:d2"), ONE_NODE)
    assert plan.placement == "disaggregated" and plan.backend == "nccl"
    assert where(plan.trainers) == [("10.0.0.1", (0,)), ("10.0.0.1", (1,))]
    assert where(plan.engines) == [("10.0.0.1", (g,)) for g in range(2, 8)]
    assert plan.engines[0].ray_options() == {
        "num_gpus": 1.0,
        "resources": {"node:10.0.0.1": 0.001},
        "runtime_env": {
            "env_vars": {
                "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
                "CUDA_VISIBLE_DEVICES": "2",
            }
        },
    }
    assert plan.warnings == ()


def test_defaults_give_one_trainer_rank_and_every_other_gpu_to_engines():
    plan = resolve(config(), ONE_NODE)
    assert (plan.placement, plan.trainer_ranks, plan.engine_replicas) == ("disaggregated", 1, 7)
    assert plan.warnings == ()


def test_collocated_engine_replicas_share_the_trainer_ranks_gpus():
    plan = resolve(config(allocation="vllm:d8|fsdp:d8"), ONE_NODE)
    assert plan.placement == "collocated"
    assert where(plan.engines) == where(plan.trainers)
    assert {b.num_gpus for b in (*plan.engines, *plan.trainers)} == {0.5}
    assert plan.warnings == ()


def test_collocated_tensor_parallel_replica_spans_its_trainer_ranks_gpus():
    plan = resolve(config(allocation="vllm:d4t2|fsdp:d8"), ONE_NODE)
    assert plan.tensor_parallel_size == 2
    assert [b.gpu_ids for b in plan.engines] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [b.num_gpus for b in plan.engines] == [0.5] * 4  # Ray counts it on one GPU
    assert plan.engines[1].ray_options()["runtime_env"]["env_vars"]["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_disaggregated_tensor_parallel_replicas_ask_ray_for_whole_gpus():
    plan = resolve(config(allocation="vllm:d3t2+fsdp:d2"), ONE_NODE)
    assert [b.gpu_ids for b in plan.engines] == [(2, 3), (4, 5), (6, 7)]
    assert [b.num_gpus for b in plan.engines] == [2.0] * 3


def test_multi_node_trainer_on_the_first_node_engines_on_the_second():
    plan = resolve(config(engine="sglang", allocation="sglang:d2t2+fsdp:d4"), TWO_NODES)
    assert where(plan.trainers) == [("10.0.0.1", (g,)) for g in range(4)]
    assert where(plan.engines) == [("10.0.0.2", (0, 1)), ("10.0.0.2", (2, 3))]
    assert plan.engines[1].ray_options()["resources"] == {"node:10.0.0.2": 0.001}


def test_trainer_ranks_cross_nodes_and_a_replica_never_does():
    plan = resolve(config(tp=3, trainer_ranks=2), TWO_NODES)
    assert where(plan.engines) == [("10.0.0.2", (0, 1, 2))]  # node 1 has 2 GPUs left, not 3
    assert plan.warnings == (
        "3 of 8 GPUs will be idle: node 10.0.0.1 GPUs 2, 3; node 10.0.0.2 GPU 3. No further "
        "replica of engine.tensor_parallel_size=3 GPUs fits on one node; give them to "
        "scheduler.trainer_ranks or change engine.tensor_parallel_size.",
    )


def test_idle_gpus_are_named_with_an_allocation_that_uses_them():
    plan = resolve(config(allocation="vllm:d4+fsdp:d2"), ONE_NODE)
    assert plan.warnings == (
        "2 of 8 GPUs will be idle: node 10.0.0.1 GPUs 6, 7. Raise scheduler.engine_replicas "
        "to 6 (scheduler.allocation='vllm:d6+fsdp:d2').",
    )
    assert resolve(config(allocation="vllm:d6+fsdp:d2"), ONE_NODE).warnings == ()


def test_idle_gpus_on_a_second_node_are_named_by_its_ip():
    plan = resolve(config(allocation="vllm:d2+fsdp:d2"), TWO_NODES)
    assert plan.warnings[0].startswith("4 of 8 GPUs will be idle: node 10.0.0.2 GPUs 0, 1, 2, 3.")


def test_collocated_with_one_trainer_rank_names_the_gpus_it_leaves_idle():
    plan = resolve(config(placement="collocated"), ONE_NODE)
    assert (plan.trainer_ranks, plan.engine_replicas) == (1, 1)
    assert plan.warnings == (
        "7 of 8 GPUs will be idle: node 10.0.0.1 GPUs 1, 2, 3, 4, 5, 6, 7. Raise "
        "scheduler.trainer_ranks to 8 (collocated engine replicas share the trainer ranks' "
        "GPUs), e.g. scheduler.allocation='vllm:d8|fsdp:d8'.",
    )


def test_collocated_trainer_gpus_without_an_engine_are_named():
    plan = resolve(config(allocation="vllm:d1|fsdp:d2"), [Node("10.0.0.1", 2)])
    assert plan.warnings == (
        "1 of the trainer ranks' 2 GPUs holds no engine replica and waits while rollouts "
        "generate: node 10.0.0.1 GPU 1. Raise scheduler.engine_replicas to 2 "
        "(scheduler.allocation='vllm:d2|fsdp:d2').",
    )


def test_auto_collocates_when_there_are_not_gpus_enough_for_both():
    plan = resolve(config(), [Node("10.0.0.1", 1)])
    assert plan.placement == "collocated"
    assert where(plan.engines) == where(plan.trainers) == [("10.0.0.1", (0,))]


def test_explicit_fields_that_agree_with_the_allocation_pass():
    agreeing = {"engine_replicas": 2, "trainer_ranks": 4, "placement": "disaggregated"}
    cfg = config(tp=2, allocation="vllm:d2t2+fsdp:d4", **agreeing)
    assert resolve(cfg, ONE_NODE).engine_replicas == 2


def test_cpu_only_cluster_deals_ranks_and_replicas_over_the_nodes_with_gloo(monkeypatch):
    monkeypatch.delenv(runtime.FORCE_CPU_VARIABLE, raising=False)
    nodes = [Node("192.0.2.2", 0), Node("192.0.2.3", 0)]
    plan = resolve(config(engine="local", allocation="local:d1+fsdp:d3"), nodes)
    assert plan.backend == "gloo" and (plan.engine_replicas, plan.trainer_ranks) == (1, 3)
    assert where(plan.engines) == [("192.0.2.2", ())]
    assert where(plan.trainers) == [("192.0.2.2", ()), ("192.0.2.3", ()), ("192.0.2.2", ())]
    assert "on the CPUs of nodes 192.0.2.2, 192.0.2.3" in plan.describe()
    alone = resolve(config(engine="local", engine_replicas=2, trainer_ranks=2), nodes[:1])
    assert where((*alone.engines, *alone.trainers)) == [("192.0.2.2", ())] * 4
    assert {b.num_gpus for b in (*plan.engines, *plan.trainers)} == {0.0}
    assert "runtime_env" not in plan.engines[0].ray_options()
    assert "collocated and disaggregated place them alike" in plan.describe()
    default = resolve(config(engine="local"), nodes)
    assert (default.engine_replicas, default.trainer_ranks) == (1, 1)


@pytest.mark.parametrize(
    ("cfg", "nodes", "expected"),
    [
        (config(trainer_ranks=9), ONE_NODE, r"trainer_ranks=9 needs 9 GPUs .* has 8"),
        (
            config(placement="disaggregated", engine_replicas=5, trainer_ranks=4),
            ONE_NODE,
            r"engine_replicas=5 x engine.tensor_parallel_size=1 need 5 GPUs.*room for 4.*"
            r"Lower scheduler.engine_replicas to 4, lower scheduler.trainer_ranks, or use "
            r"scheduler.placement=collocated",
        ),
        (
            config(allocation="vllm:d3t2|fsdp:d4"),
            ONE_NODE,
            r"placement=collocated \(from scheduler.allocation='vllm:d3t2\|fsdp:d4'\): .*"
            r"need 6 GPUs.*replicas share the trainer ranks' GPUs.*room for 2.*Lower "
            r"scheduler.engine_replicas to 2, or raise scheduler.trainer_ranks to 6",
        ),
        (  # 2 + 2 trainer GPUs on two nodes: a 2-GPU replica per node, not 3 of them
            config(allocation="vllm:d2t2|fsdp:d4"),
            [Node("10.0.0.1", 3), Node("10.0.0.2", 3)],
            r"trainer_ranks=4 \(node 10.0.0.1: 3 GPUs, node 10.0.0.2: 1 GPU\) have room for 1",
        ),
        (
            config(tp=2),
            [Node("10.0.0.1", 2)],
            r"placement=auto: one engine replica x engine.tensor_parallel_size=2 needs 2 GPUs"
            r".*Raise scheduler.trainer_ranks to 2 \(collocated\)",
        ),
        (
            config(allocation="vllm:d2+fsdp:d2", engine_replicas=3),
            ONE_NODE,
            r"scheduler.engine_replicas=3 disagrees with scheduler.allocation='vllm:d2\+fsdp:d2'"
            r", which sets it to 2",
        ),
        (
            config(allocation="vllm:d2+fsdp:d2", trainer_ranks=1),
            ONE_NODE,
            r"scheduler.trainer_ranks=1 disagrees",
        ),
        (
            config(allocation="vllm:d2+fsdp:d2", placement="collocated"),
            ONE_NODE,
            r"scheduler.placement=collocated disagrees .* sets it to disaggregated",
        ),
        (
            config(tp=4, allocation="vllm:d2t2+fsdp:d2"),
            ONE_NODE,
            r"engine.tensor_parallel_size=4 disagrees .* sets it to 2",
        ),
        (
            config(allocation="local:d1+fsdp:d1"),
            ONE_NODE,
            r"names engine 'local', and engine.type is 'vllm'; write 'vllm' in the allocation "
            r"or set engine.type=local",
        ),
        (
            config(allocation="vllm:d1t2+fsdp:d1"),
            [Node("192.0.2.2", 0)],
            r"engine.tensor_parallel_size=2 \(from scheduler.allocation=.*\) shards the model "
            r"over GPUs, and the Ray cluster has none",
        ),
        (config(), [], "no alive node"),
    ],
)
def test_plans_that_cannot_be_made_name_fields_and_counts(cfg, nodes, expected):
    with pytest.raises(ConfigError, match=expected):
        resolve(cfg, nodes)


def test_allocation_string_round_trips():
    for text in ["vllm:d6+fsdp:d2", "vllm:d4t2|fsdp:d8", "local:d1+fsdp:d2"]:
        assert str(parse_allocation(text, text.split(":")[0])) == text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("vllm:d2", "joined by one '\\+' .* or '\\|'"),
        ("vllm:d2+fsdp:d2|fsdp:d2", "joined by one"),
        ("fsdp:d2|vllm:d2", "the engine part comes first, write 'vllm:d2\\|fsdp:d2'"),
        ("vllm:2+fsdp:d2", "the engine part 'vllm:2' must read ENGINE:dN"),
        ("vllm:d2+megatron:d2", "the trainer part 'megatron:d2' must read fsdp:dN"),
        ("vllm:d0+fsdp:d1", "counts in 'vllm:d0' start at 1"),
    ],
)
def test_malformed_allocations_name_the_part_and_show_an_example(text, expected):
    with pytest.raises(ConfigError, match=expected) as error:
        parse_allocation(text, "vllm")
    assert f"scheduler.allocation={text!r}" in str(error.value)
    assert "e.g. 'vllm:d2+fsdp:d2'" in str(error.value)


def test_local_engine_has_no_tensor_parallelism():
    with pytest.raises(ConfigError, match="only vllm and sglang servers shard"):
        parse_allocation("local:d1t2+fsdp:d1", "local")


def test_actors_started_with_the_plans_options_see_their_planned_gpus():
    """Ray alone would put both 0.5-GPU trainer ranks on GPU 0; the plan's options bind
    each actor to its GPUs. Ray counts GPUs it is told of, so this runs without any."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=1, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        nodes = cluster_nodes()
        plan = resolve(config(engine="local", allocation="local:d2|fsdp:d2"), nodes)
        visible = ray.remote(lambda: os.environ["CUDA_VISIBLE_DEVICES"])
        seen = ray.get(
            [
                visible.options(num_cpus=0, **b.ray_options()).remote()
                for b in (*plan.trainers, *plan.engines)
            ],
            timeout=120,
        )
    finally:
        ray.shutdown()
    assert nodes == [Node(nodes[0].ip, 2)]
    assert seen == ["0", "1", "0", "1"]


def test_actors_inherit_a_forced_cpu(monkeypatch):
    """LOOPRL_FORCE_CPU reaches Ray actors on every node through their runtime_env."""
    bundle = Bundle(role="engine", index=0, node_ip="127.0.0.1", gpu_ids=(), num_gpus=0)
    monkeypatch.setenv(runtime.FORCE_CPU_VARIABLE, "avx2")
    env = bundle.ray_options()["runtime_env"]["env_vars"]
    assert env == {runtime.FORCE_CPU_VARIABLE: "avx2", **runtime.FORCED_CPU_SETTINGS["avx2"]}
    monkeypatch.delenv(runtime.FORCE_CPU_VARIABLE)
    assert "runtime_env" not in bundle.ray_options()
