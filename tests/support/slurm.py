"""A one-node Slurm cluster on this machine, for the tests that submit the sbatch template
(examples/slurm/looprl.sbatch) to a real controller.

`one_node_cluster(root)` starts Debian's slurm-wlm (`make slurm` installs it) the way a
site runs it, in miniature: a slurm.conf generated under `root` (this host as controller
and its only node, CPUs=2, free ports, state, spool, pid files and logs under `root`),
`munged`, `slurmctld -D` and `slurmd -D` as child processes, every client pointed at the
conf by SLURM_CONF. It yields once `sinfo` shows the node idle, and on the way out stops
the daemons and kills every process a job left (the jobs' Ray nodes included): each
process of a job carries SLURM_CONF=<this conf> in its environment, so leftovers are found
by that, never by name.

Authentication is munge, with a key generated under `root` and a `munged` of its own on
its own socket (AuthInfo=socket=...): Slurm 22.05 still has auth/none, but 23.11 removed
it, and munge is what every real cluster runs. No cgroups (proctrack/linuxproc,
task/none: a container rarely lets slurmd manage them), no accounting database.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from looprl.engines.servers.process import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scancel", "scontrol", "sinfo")
# Seconds between a cancel's SIGTERM and its SIGKILL (Slurm's default, set explicitly):
# all a plain `scancel` gives `looprl train` to exit once its Ray is gone. The graceful
# stop (`scancel --batch --signal=TERM`, `--signal=B:TERM@N`) sends no SIGKILL at all.
KILL_WAIT_S = 30
# Job records stay this long after a job ends, for `scontrol show job` to read its state.
MIN_JOB_AGE_S = 600
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
ENDED |= {"PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def skip_reason() -> str | None:
    """Why a Slurm cluster cannot be started here, or None."""
    missing = [name for name in DAEMONS + CLIENTS if not _which(name)]
    if missing:
        return f"Debian's slurm-wlm is not installed (`make slurm`): no {', '.join(missing)}"
    if os.geteuid() != 0:
        return "slurmd runs jobs as their submitting user and needs root for it"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


class SlurmError(RuntimeError):
    pass


@dataclass
class Cluster:
    root: Path
    conf: Path
    host: str
    env: dict[str, str]  # what a client runs with: SLURM_CONF, and PATH with this venv
    jobs: list[str] = field(default_factory=list)

    def run(self, *command: str, timeout: float = 60, env=None, cwd=None) -> str:
        """Run a Slurm client command; its stdout. SlurmError, with its stderr, on failure."""
        done = subprocess.run(
            command, env=env or self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise SlurmError(f"{' '.join(command)}: exit {done.returncode}: {done.stderr}")
        return done.stdout

    def sbatch(self, *args: str, env: dict[str, str] | None = None, cwd: Path) -> str:
        """Submit with `sbatch --parsable ARGS` (from `cwd`, `env` added to the client's
        environment, which sbatch passes on to the job); the job id."""
        command = ("sbatch", "--parsable", *args)
        job = self.run(*command, env={**self.env, **(env or {})}, cwd=cwd).strip()
        self.jobs.append(job.split(";")[0])
        return self.jobs[-1]

    def job(self, job: str) -> dict[str, str]:
        """`scontrol show job -o JOB` as a dict (JobState, ExitCode, StdOut, ...)."""
        line = self.run("scontrol", "show", "job", "-o", job).strip()
        return dict(item.split("=", 1) for item in line.split() if "=" in item)

    def wait(self, job: str, timeout: float) -> dict[str, str]:
        """Wait until JOB has ended (and left COMPLETING: its processes are gone); its
        `job` record."""
        deadline = time.monotonic() + timeout
        while (info := self.job(job))["JobState"] not in ENDED:
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job} still {info['JobState']} after {timeout:g} s")
            time.sleep(0.5)
        return info

    def processes(self, job: str | None = None) -> list[psutil.Process]:
        """The live processes of this cluster's jobs (of JOB alone when given), daemons
        aside: those whose environment has this SLURM_CONF (and SLURM_JOB_ID=JOB)."""
        found = []
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):  # gone meanwhile, or a zombie
                if process.pid == os.getpid() or process.status() == psutil.STATUS_ZOMBIE:
                    continue
                env = process.environ()
                if env.get("SLURM_CONF") != str(self.conf) or "SLURM_JOB_ID" not in env:
                    continue
                if job is None or env["SLURM_JOB_ID"] == job:
                    found.append(process)
        return found

    def left_running(self, job: str, within_s: float = 15) -> list[str]:
        """The command lines of JOB's processes still alive `within_s` after it ended (a
        killed step's processes take a moment to go)."""
        deadline = time.monotonic() + within_s
        while (left := self.processes(job)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return [" ".join(_cmdline(p)) for p in left]


def _cmdline(process: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return process.cmdline()
    return [f"pid {process.pid}"]


def _write_conf(root: Path, host: str) -> Path:
    for folder in ("state", "spool"):
        (root / folder).mkdir()
    conf = root / "slurm.conf"
    lines = [
        "ClusterName=looprl-test",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge.socket'}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        # The node as configured, whatever this machine has (a 1-core CI runner, 64 cores).
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        f"KillWait={KILL_WAIT_S}",
        f"MinJobAge={MIN_JOB_AGE_S}",
        # Job ids apart from an earlier cluster's: the template's Ray uses /tmp/ray-JOBID.
        f"FirstJobId={random.randrange(100_000, 1_000_000)}",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=2048 State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
    ]
    conf.write_text("\n".join(lines) + "\n")
    return conf


def _start(name: str, args: list[str], root: Path, env: dict[str, str]) -> subprocess.Popen:
    log = (root / f"{name}.out").open("wb")
    # Its own session: a Ctrl-C at pytest's terminal reaches the finalizer, not the daemons.
    return subprocess.Popen(
        [_which(name), *args], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _stop(process: subprocess.Popen, grace_s: float = 10) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"(no {path.name})"


@contextlib.contextmanager
def one_node_cluster(root: Path, timeout_s: float = 60) -> Iterator[Cluster]:
    """A Slurm cluster of this one host, its files under `root` (see the module's doc)."""
    host = socket.gethostname().split(".")[0]
    conf = _write_conf(root, host)
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": f"{venv_bin}:{os.environ['PATH']}"}
    cluster = Cluster(root, conf, host, env)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    daemons: list[subprocess.Popen] = []
    try:
        # -f: munged refuses a socket under a folder others cannot enter (pytest's are 0700)
        munge = [
            "-F",
            "-f",
            f"--socket={root / 'munge.socket'}",
            f"--key-file={key}",
            f"--log-file={root / 'munged.log'}",
            f"--pid-file={root / 'munged.pid'}",
            f"--seed-file={root / 'munged.seed'}",
        ]
        daemons.append(_start("munged", munge, root, env))
        _wait_for(lambda: (root / "munge.socket").exists(), daemons, root, timeout_s, "munged")
        daemons.append(_start("slurmctld", ["-D"], root, env))
        daemons.append(_start("slurmd", ["-D", "-N", host], root, env))

        def idle() -> bool:
            with contextlib.suppress(SlurmError):
                return cluster.run("sinfo", "-h", "-N", "-o", "%T", timeout=10).strip() == "idle"
            return False

        _wait_for(idle, daemons, root, timeout_s, "the node idle in sinfo")
        yield cluster
    finally:
        for process in reversed(daemons[1:]):  # slurmd, slurmctld
            _stop(process)
        # What the jobs left: with proctrack/linuxproc, a process whose parent died
        # (reparented to init) escapes its step's kill.
        for process in cluster.processes():
            with contextlib.suppress(psutil.Error):
                process.kill()
        for process in daemons[:1]:  # munged
            _stop(process)
        for job in cluster.jobs:
            shutil.rmtree(f"/tmp/ray-{job}", ignore_errors=True)


def _wait_for(ready, daemons: list[subprocess.Popen], root: Path, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not ready():
        dead = [p for p in daemons if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(
                f"--- {name}:\n{_tail(root / f'{name}.out')}"
                for name in DAEMONS
                if (root / f"{name}.out").exists()
            )
            exited = ", ".join(f"{p.args[0]} exited {p.returncode}" for p in dead)
            raise SlurmError(
                f"no {what} after {timeout_s:g} s ({exited or 'still waiting'}):\n{logs}"
            )
        time.sleep(0.3)
