"""ServerProcess with real child processes: healthy start, early exit, no answer, stop."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

from looprl.engines.servers.process import ServerError, ServerProcess, free_port


def test_a_server_that_answers_is_started_and_its_whole_group_stopped(tmp_path):
    port = free_port()
    # the server starts a child in its process group, as vLLM starts its engine core; this
    # one ignores SIGTERM, so only the SIGKILL to what is left of the group ends it
    child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    script = (
        "import subprocess, sys, http.server;"
        f"subprocess.Popen([sys.executable, '-c', {child!r}]);"
        f"http.server.test(http.server.SimpleHTTPRequestHandler, port={port}, bind='127.0.0.1')"
    )
    server = ServerProcess(
        [sys.executable, "-c", script],
        url=f"http://127.0.0.1:{port}",
        log_path=tmp_path / "logs" / "server.log",
        health_path="/",
        startup_timeout_s=30,
    ).start()
    assert server.alive
    assert httpx.get(server.url + "/").status_code == 200
    group = _group_members(server.pid)
    assert len(group) == 2  # the server and its child
    server.stop()
    assert not server.alive
    deadline = time.monotonic() + 5  # SIGKILL is delivered asynchronously
    while any(_state(pid) not in ("gone", "Z") for pid in group):  # zombies until reaped
        assert time.monotonic() < deadline, {pid: _state(pid) for pid in group}
        time.sleep(0.05)
    assert server.log_path.read_text().startswith(f"$ {sys.executable} -c")


def test_a_server_that_exits_while_starting_reports_its_log(tmp_path):
    script = "import sys; print('loading weights'); print('boom: no such model'); sys.exit(3)"
    server = ServerProcess(
        [sys.executable, "-c", script],
        url=f"http://127.0.0.1:{free_port()}",
        log_path=tmp_path / "server.log",
        name="vLLM server",
    )
    with pytest.raises(ServerError, match=r"vLLM server exited with code 3") as error:
        server.start()
    message = str(error.value)
    assert str(tmp_path / "server.log") in message and "boom: no such model" in message


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    server = ServerProcess(
        [sys.executable, "-c", "import time; print('still loading', flush=True); time.sleep(60)"],
        url=f"http://127.0.0.1:{free_port()}",
        log_path=tmp_path / "server.log",
        startup_timeout_s=2,
    )
    with pytest.raises(ServerError, match=r"did not answer .*/health within 2 s") as error:
        server.start()
    assert "still loading" in str(error.value)
    assert not server.alive


def _group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, ...
            members.append(int(stat.parent.name))
    return members


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
