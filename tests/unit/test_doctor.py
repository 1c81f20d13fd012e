"""`looprl doctor` on this machine (no GPU, no EGL); failures forced where they can be."""

import socket
import sys

import pytest
from typer.testing import CliRunner

from looprl.cli import app
from looprl.commands import doctor
from looprl.config import load_config


def _by_name(checks):
    return {c.name: c for c in checks}


def _any_free_disk_will_do(monkeypatch):
    """The disk check compares this machine's free space with MIN_FREE_GB; these tests are
    about the other checks, so the threshold goes to zero (test_little_disk_fails has it)."""
    monkeypatch.setattr(doctor, "MIN_FREE_GB", 0)


def test_this_machine_cpu_only_without_egl(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("MUJOCO_GL", raising=False)
    _any_free_disk_will_do(monkeypatch)
    checks = _by_name(doctor.run_checks(load_config(None, [f"run.fileroot={tmp_path}"])))
    assert checks["config"].status == "ok"  # the start-up checks of `looprl train`
    assert checks["torch"].status == "ok" and "CPU build" in checks["torch"].detail
    assert checks["GPUs"].status == "ok" and "no GPU" in checks["GPUs"].detail
    assert checks["disk"].status == "ok" and "GB free under" in checks["disk"].detail
    # A single-process run that plays no env needs neither Ray nor rendering.
    assert not {"Ray", "node IP", "EGL", "MUJOCO_GL"} & set(checks)
    assert all(c.status != "fail" for c in checks.values())
    egl = _by_name(doctor.check_rendering())["EGL"]
    assert egl.status == "warn" and "libEGL_nvidia.so.0" in egl.detail
    assert "MUJOCO_GL=osmesa" in egl.fix


def test_ray_checks_only_for_a_ray_run(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    _any_free_disk_will_do(monkeypatch)
    cfg = load_config(None, [f"run.fileroot={tmp_path}", "scheduler.type=ray"])
    checks = _by_name(doctor.run_checks(cfg))
    assert {"Ray", "node IP"} <= set(checks)


def test_egl_rendering_asked_for_without_egl_fails(monkeypatch, tmp_path):
    # glvnd pointed at no vendor library: what a machine without an EGL driver looks like
    # (this one renders with MUJOCO_GL=egl through Mesa's).
    monkeypatch.setenv("MUJOCO_GL", "egl")
    monkeypatch.setenv("__EGL_VENDOR_LIBRARY_FILENAMES", str(tmp_path / "none.json"))
    check = _by_name(doctor.check_rendering())["MUJOCO_GL"]
    assert check.status == "fail" and "MUJOCO_GL=osmesa" in check.fix


def test_a_taken_port_and_an_unreachable_ray_fail_with_their_fix():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        check = doctor.check_port("127.0.0.1", port)
        assert check.status == "fail" and "gateway.port=0" in check.fix
        assert doctor.check_ray(f"127.0.0.1:{port}").status == "ok"  # something answers
    closed = doctor.check_ray(f"127.0.0.1:{port}")
    assert closed.status == "fail" and "ray start --head" in closed.fix


def test_little_disk_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "MIN_FREE_GB", 1e9)
    check = doctor.check_disk(tmp_path / "runs" / "not-yet")
    assert check.status == "fail" and "checkpoint.keep_last" in check.fix


@pytest.mark.parametrize(("taken", "code"), [(True, 1), (False, 0)])
def test_cli_exit_code_says_whether_a_check_failed(tmp_path, monkeypatch, taken, code):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("MUJOCO_GL", raising=False)
    _any_free_disk_will_do(monkeypatch)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1] if taken else 0
        result = CliRunner().invoke(
            app, ["doctor", f"gateway.port={port}", f"run.fileroot={tmp_path}"]
        )
    assert result.exit_code == code, result.output


def test_the_code_sandbox_fails_only_where_the_config_uses_it(tmp_path, monkeypatch):
    from looprl.rewards.sandbox import bubblewrap_missing

    code = load_config(None, ["reward.type=code"])
    if bubblewrap_missing() is None:
        assert doctor.check_sandbox(code).status == "ok"
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    check = doctor.check_sandbox(code)
    assert check.status == "fail" and "apt-get install bubblewrap" in check.detail
    assert "reward.code.isolation=unisolated" in check.fix
    unused = doctor.check_sandbox(load_config(None, []))
    assert unused.status == "ok" and unused.detail.startswith("not used (reward.type=function)")
    unisolated = load_config(None, ["reward.type=code", "reward.code.isolation=unisolated"])
    assert doctor.check_sandbox(unisolated).status == "warn"


def test_a_named_cluster_without_ray_installed_fails_with_the_extra(monkeypatch):
    # None in sys.modules is Python's own "cannot be imported": find_spec answers None.
    monkeypatch.setitem(sys.modules, "ray", None)
    (check,) = doctor.check_ray_nodes("10.0.0.1:6379")
    assert check.status == "fail" and "ray is not installed" in check.detail
    assert check.fix == "pip install 'looprl[ray]'"
