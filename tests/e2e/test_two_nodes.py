"""The Ray scheduler on two Ray nodes joined by a network (tests/support/two_nodes.py:
two network namespaces of this machine), the driver (`looprl train`, `looprl doctor`)
on the head's: actors spread over both nodes and the run learns with weights broadcast
across them; a worker node lost mid-run stops the run, naming the node, in bounded
time; a node announcing an address the head cannot reach is named, with the fix, by
`looprl doctor` and by the run at once instead of hanging it."""

from __future__ import annotations

import json
import sys
import time

import pytest

from looprl.config import load_config
from tests.support.toy_job import learned_steps, toy_job_overrides
from tests.support.two_nodes import HEAD_IP, WORKER_IP, TwoNodes, netns_unavailable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(why := netns_unavailable()), reason=f"two nodes: {why}"),
]

LOOPRL = [sys.executable, "-m", "looprl.cli"]
UNREACHABLE_IP = "10.232.0.2"  # on the worker's interface; the head has no route to it


@pytest.fixture(scope="module")
def two_nodes():
    nodes = TwoNodes.start()
    yield nodes
    nodes.close()


def two_node_job(model_dir, root, address: str, *overrides: str) -> list[str]:
    """The toy job on 2 engine replicas and 2 trainer ranks, weights broadcast."""
    return toy_job_overrides(
        model_dir,
        root,
        "scheduler.type=ray",
        f"scheduler.ray_address={address}",
        "scheduler.engine_replicas=2",
        "scheduler.trainer_ranks=2",
        "scheduler.weight_sync=broadcast",
        "scheduler.bucket_mb=1",  # several buckets cross the network
        *overrides,
    )


def test_ranks_and_replicas_spread_over_two_nodes_and_learn(two_nodes, peaked_model_dir, tmp_path):
    overrides = two_node_job(peaked_model_dir, tmp_path, two_nodes.address)
    cfg = load_config(None, overrides)
    done = two_nodes.run([*LOOPRL, "train", *overrides], timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + two_nodes.logs()

    report = json.loads((cfg.run_dir / "placement.json").read_text())
    print("placement:", json.dumps(report["actors"]))
    where = {(a["kind"], a["index"]): a["node"] for a in report["actors"]}
    assert where == {
        ("trainer_rank", 0): HEAD_IP,
        ("trainer_rank", 1): WORKER_IP,
        ("engine_replica", 0): HEAD_IP,
        ("engine_replica", 1): WORKER_IP,
    }, report
    assert all(a["node"] == a["planned_node"] for a in report["actors"]), report
    assert {a["backend"] for a in report["actors"] if a["kind"] == "trainer_rank"} == {"gloo"}
    assert len({a["pid"] for a in report["actors"]}) == 4
    steps = learned_steps(cfg, "two nodes, 2 replicas, 2 ranks, broadcast")
    assert [r["staleness_max"] for r in steps] == [0] * 10


def test_doctor_and_run_name_a_node_the_head_cannot_reach(peaked_model_dir, tmp_path):
    """A worker announcing 10.232.0.2, an address of its machine the head has no route
    to: Ray registers it (it dials the head), and its health checks fail. The head here
    tolerates many failed checks, as the first ~20 s after such a node joins do by
    default (5 failures), so the node stays listed alive while doctor and the run look."""
    nodes = TwoNodes.start(head_env={"RAY_health_check_failure_threshold": "1000"}, worker=False)
    try:
        nodes.add_worker("unreachable", UNREACHABLE_IP)
        doctor = nodes.run(
            [*LOOPRL, "doctor", f"scheduler.ray_address={nodes.address}"], timeout=120
        )
        said = " ".join(doctor.stdout.split())
        assert f"node {UNREACHABLE_IP} announced the address {UNREACHABLE_IP}" in said, said
        assert f"ray start --address={nodes.address} --node-ip-address=" in said, said
        assert "LOOPRL_NET_IFACE" in said, said
        assert "1 of 2 alive node(s) answer" in said, said

        overrides = two_node_job(peaked_model_dir, tmp_path, nodes.address)
        started = time.monotonic()
        run = nodes.run([*LOOPRL, "train", *overrides], timeout=120)
        took = time.monotonic() - started
        said = " ".join(run.stdout.split())
        print(f"looprl train took {took:.0f} s, exit {run.returncode}:", said[-1500:])
        assert run.returncode == 1, run.stdout[-6000:]
        assert f"node {UNREACHABLE_IP} announced the address {UNREACHABLE_IP}" in said, said
        assert "--node-ip-address=" in said, said
        assert took < 60, took  # start-up, the Ray connection, one 3 s connect timeout
    finally:
        nodes.close()


def test_worker_node_lost_mid_run_stops_the_run_naming_it(two_nodes, peaked_model_dir, tmp_path):
    """SIGKILL every process of the worker's namespace (its raylet, rank 1, replica 1)
    after the first steps. A trainer rank's loss stops a data-parallel run
    (docs/diagnosing.md: a dead rank stops the run naming it); the error names the node,
    and the driver exits well within the collective timeout."""
    overrides = two_node_job(peaked_model_dir, tmp_path, two_nodes.address, "train.total_steps=40")
    cfg = load_config(None, overrides)
    log = tmp_path / "train.out"
    train = two_nodes.popen([*LOOPRL, "train", *overrides], log)
    try:
        deadline = time.monotonic() + 300
        metrics = cfg.run_dir / "metrics.jsonl"
        while not (metrics.exists() and '"kind": "train"' in metrics.read_text()):
            assert train.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, log.read_text()[-6000:]
            time.sleep(0.2)
        killed = two_nodes.kill_namespace(two_nodes.worker_ns)
        lost = time.monotonic()
        assert killed
        code = train.wait(timeout=120)
        took = time.monotonic() - lost
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
    said = " ".join(log.read_text().split())
    print(f"exit {code} {took:.0f} s after the node was lost:", said[-3000:])
    assert code != 0
    assert f"on node {WORKER_IP}) died" in said, said[-6000:]
    assert f"Ray lost node {WORKER_IP}" in said, said[-6000:]
    assert took < 60, took
