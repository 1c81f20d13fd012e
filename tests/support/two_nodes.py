"""Two Ray nodes on this one machine: a head and a worker, each in a network namespace
of its own, joined by a veth pair, so that every actor, store and collective crosses a
real (virtual) network between two addresses, as on two machines.

`TwoNodes.start` makes namespaces `lrl<pid><random>a` (10.231.0.1/24) and `...b`
(10.231.0.2/24), starts a Ray head in the first and a worker node in the second (one CPU
each), and returns the cluster; `run`/`popen` start a command in the head's namespace,
where the driver (`looprl train`, `looprl doctor`) runs. `close` kills every process in
both namespaces (`ip netns pids`), deletes them and the Ray temp dirs: nothing is left
behind, whatever failed. `netns_unavailable()` says why the machine cannot host them (not
root, no `ip`, namespaces refused), for a skip.

A node may announce an address its peers cannot reach (`add_worker(..., announce=...)`,
the address on B's interface but in a subnet A has no route to): Ray registers it, and
its GCS marks it dead once health checks have failed `RAY_health_check_failure_threshold`
times (5 by default, about 20 s); `head_env` raises that to keep such a node registered
while a test looks at it.

Every process gets the same environment: this checkout on PYTHONPATH (actors import the
tests' workflows), Ray's token auth off and no token file (another Ray on this machine
may have left ~/.ray/auth_token, which made a worker's join fail "InvalidAuthToken").
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SUBNET = "10.231.0"
HEAD_IP, WORKER_IP = f"{SUBNET}.1", f"{SUBNET}.2"
RAY_PORT = 6379
OBJECT_STORE_BYTES = 200 * 2**20  # per node; the tiny models' weights are a few MiB


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces"
    name = f"lrl{os.getpid()}probe"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class TwoNodes:
    """A Ray cluster of a head (namespace `head_ns`, HEAD_IP) and a worker (`worker_ns`,
    WORKER_IP)."""

    head_ns: str
    worker_ns: str
    tmp: Path  # Ray's temp dirs, one per node, and the nodes' logs
    env: dict[str, str]  # for every process started in the namespaces
    namespaces: list[str] = field(default_factory=list)  # made so far, for close

    @property
    def address(self) -> str:
        return f"{HEAD_IP}:{RAY_PORT}"

    @classmethod
    def start(cls, head_env: dict[str, str] | None = None, worker: bool = True) -> TwoNodes:
        """Namespaces, veth pair, Ray head and (`worker`) a worker node announcing
        WORKER_IP; on any failure, what was made is removed before the error propagates."""
        tag = f"lrl{os.getpid()}{os.urandom(2).hex()}"
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),  # actors import the tests' workflows, as the driver does
            "PATH": f"{BIN}:{os.environ['PATH']}",
            "RAY_USAGE_STATS_ENABLED": "0",
            "COLUMNS": "1000",  # rich (looprl's tables and errors) wraps nothing
            # Hermetic: no token another Ray left in ~/.ray/auth_token (Ray 2.60 reads it).
            "RAY_AUTH_MODE": "disabled",
            "RAY_AUTH_TOKEN_PATH": "/nonexistent/looprl-test-auth-token",
        }
        for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
            env.pop(name, None)
        tmp = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir="/tmp"))  # short: Ray's socket paths
        nodes = cls(f"{tag}a", f"{tag}b", tmp, env)
        try:
            nodes._network(tag)
            nodes._ray_start(
                nodes.head_ns,
                "head",
                [
                    "--head",
                    f"--node-ip-address={HEAD_IP}",
                    f"--port={RAY_PORT}",
                    "--include-dashboard=false",
                ],
                head_env or {},
            )
            if worker:
                nodes.add_worker("worker", WORKER_IP)
        except BaseException:
            nodes.close()
            raise
        return nodes

    def _network(self, tag: str) -> None:
        for ns in (self.head_ns, self.worker_ns):
            _ip("netns", "add", ns)
            self.namespaces.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        # Created in the head's namespace, so nothing is left in the root one if a step fails.
        _ip("-n", self.head_ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        _ip("-n", self.head_ns, "link", "set", "v1", "netns", self.worker_ns)
        for ns, dev, ip in ((self.head_ns, "v0", HEAD_IP), (self.worker_ns, "v1", WORKER_IP)):
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")

    def add_worker(self, name: str, announce: str) -> None:
        """Start a worker node in the worker's namespace announcing `announce`; an address
        outside SUBNET is first added to its interface, where the head has no route to it."""
        if not announce.startswith(f"{SUBNET}."):
            _ip("-n", self.worker_ns, "addr", "add", f"{announce}/24", "dev", "v1")
        self._ray_start(
            self.worker_ns,
            name,
            [f"--address={self.address}", f"--node-ip-address={announce}"],
            {},
        )

    def _ray_start(self, ns: str, name: str, args: list[str], env: dict[str, str]) -> None:
        temp = self.tmp / name
        temp.mkdir()
        command = [
            *self.netns_exec(ns),
            "ray",
            "start",
            *args,
            "--num-cpus=1",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ]
        started = subprocess.run(
            command,
            env={**self.env, **env},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )
        (self.tmp / f"{name}.log").write_text(started.stdout)
        if started.returncode != 0:
            raise RuntimeError(f"`ray start` of the {name} node failed:\n{started.stdout}")

    def netns_exec(self, ns: str | None = None) -> list[str]:
        return ["ip", "netns", "exec", ns or self.head_ns]

    def run(self, command: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        """`command` in the head's namespace; stdout and stderr together, as text."""
        return subprocess.run(
            [*self.netns_exec(), *command],
            env=self.env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            **kw,
        )

    def popen(self, command: list[str], log: Path) -> subprocess.Popen:
        """`command` in the head's namespace, its output into `log`."""
        with log.open("w") as out:
            return subprocess.Popen(
                [*self.netns_exec(), *command],
                env=self.env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def pids(self, ns: str) -> list[int]:
        listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        return [int(p) for p in listed.stdout.split()]

    def kill_namespace(self, ns: str) -> list[int]:
        """SIGKILL every process in `ns` until none is left (a dying raylet's children
        may still start); returns the pids killed."""
        killed: list[int] = []
        deadline = time.monotonic() + 30
        while (pids := self.pids(ns)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                killed.append(pid)
            time.sleep(0.2)
        return killed

    def close(self) -> None:
        """Kill every process in both namespaces, delete them and the temp dirs."""
        for ns in self.namespaces:
            self.kill_namespace(ns)
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def logs(self) -> str:
        """The `ray start` output of each node, for a failing test's message."""
        return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(self.tmp.glob("*.log")))
