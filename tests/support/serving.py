"""A test server run as a real subprocess: ready once /health answers, stopped by Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from looprl.engines.servers.process import free_port

__all__ = ["free_port", "running_server"]


@contextmanager
def running_server(cmd: list[str], port: int, **popen) -> Iterator[dict]:
    """Run `cmd` (serving on 127.0.0.1:`port`); yield its /health JSON once it answers.

    On exit it is sent SIGINT and must exit 0 within 30 s (a graceful stop), else the
    test fails with its stderr.
    """
    process = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, **popen)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stderr.read()
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/health")
                response.raise_for_status()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, f"{cmd[:4]} did not listen within 60 s"
                time.sleep(0.2)
        yield response.json()
    finally:
        process.send_signal(signal.SIGINT)
        try:
            assert process.wait(timeout=30) == 0, process.stderr.read()
        finally:
            process.kill()  # a no-op once it has exited
