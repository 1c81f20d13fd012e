"""examples/slurm/looprl.sbatch: its syntax, and the head IP it picks, under real bash."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).parents[2] / "examples" / "slurm" / "looprl.sbatch"


def bash(script: str, **env: str) -> subprocess.CompletedProcess:
    """Run `script` in bash with the template sourced; LOOPRL_* and SLURM_* only from `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPRL_", "SLURM_"))}
    return subprocess.run(
        ["bash", "-c", f'source "{TEMPLATE}"; {script}'],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_template_is_valid_bash():
    subprocess.run(["bash", "-n", str(TEMPLATE)], check=True)


def test_sourcing_defines_functions_and_starts_nothing():
    done = bash("type -t head_ip iface_ip join_ray wait_for_nodes main")
    assert done.returncode == 0 and done.stdout.split() == ["function"] * 5
    assert done.stderr == ""


def test_head_ip_given_is_used_as_it_is():
    done = bash("head_ip node-001", LOOPRL_HEAD_IP="10.1.2.3", LOOPRL_NET_IFACE="lo")
    assert (done.returncode, done.stdout) == (0, "10.1.2.3\n")


@pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2's `ip`")
def test_head_ip_of_the_named_interface():
    done = bash("head_ip node-001", LOOPRL_NET_IFACE="lo")
    assert (done.returncode, done.stdout) == (0, "127.0.0.1\n")


def test_an_interface_without_an_address_is_named_with_the_ones_there_are():
    done = bash("head_ip node-001", LOOPRL_NET_IFACE="nosuch0")
    assert done.returncode == 1 and done.stdout == ""
    assert "LOOPRL_NET_IFACE=nosuch0 has no IPv4 address" in done.stderr
    assert " lo " in done.stderr


def test_a_hostname_resolving_to_loopback_only_is_refused():
    done = bash("head_ip localhost")
    assert done.returncode == 1 and done.stdout == ""
    assert "localhost resolves to no IPv4 address but loopback" in done.stderr
    assert "set LOOPRL_HEAD_IP=IP or LOOPRL_NET_IFACE=INTERFACE" in done.stderr


def test_run_outside_slurm_says_how_to_submit():
    done = subprocess.run(
        ["bash", str(TEMPLATE), "config.yaml"],
        env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "usage: sbatch [options]" in done.stderr
