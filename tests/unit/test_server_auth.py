"""The middleware vLLM servers started by looprl load: every path but /health needs the
server's key, compared in constant time; it refuses to start without one."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

import looprl.engines.servers.vllm_server as vllm_server

sys.path.insert(0, str(Path(vllm_server.__file__).with_name("auth")))
from looprl_server_auth import RequireKey  # noqa: E402  (as the server imports it)


def _app() -> FastAPI:
    app = FastAPI()
    for path in ("/health", "/collective_rpc", "/pause", "/v1/completions"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST"])
    app.add_middleware(RequireKey)  # as vLLM's --middleware adds it: no arguments
    return app


async def test_every_path_but_health_needs_the_key(monkeypatch):
    monkeypatch.setenv("LOOPRL_SERVER_API_KEY", "s3cret")
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://server") as http:
        assert (await http.get("/health")).status_code == 200
        for path in ("/collective_rpc", "/pause", "/v1/completions", "/docs", "/nowhere"):
            for auth in (None, "Bearer wrong", "s3cret", "Basic s3cret", "Bearer s3cret2"):
                headers = {"Authorization": auth} if auth else {}
                response = await http.post(path, headers=headers)
                assert response.status_code == 401, (path, auth)
                assert "Unauthorized" in response.json()["error"]
            ok = await http.post(path, headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code != 401


def test_refuses_to_serve_without_a_key(monkeypatch):
    monkeypatch.delenv("LOOPRL_SERVER_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="LOOPRL_SERVER_API_KEY"):
        RequireKey(_app())


def test_each_server_gets_its_own_key_in_its_environment(tmp_path):
    servers = [vllm_server.VLLMServer(Path("python"), tmp_path, tmp_path / "log") for _ in "ab"]
    keys = [s.api_key for s in servers]
    assert keys[0] != keys[1] and all(len(k) >= 32 for k in keys)
    for server in servers:
        env, cmd = server.process._env, server.process.cmd
        assert env["LOOPRL_SERVER_API_KEY"] == env["VLLM_API_KEY"] == server.api_key
        assert server.api_key not in " ".join(cmd)  # not readable in `ps` by other users
        assert "looprl_server_auth.RequireKey" in cmd and "127.0.0.1" in cmd
        assert env["PYTHONPATH"].split(":")[0].endswith("servers/auth")
        assert server.process.api_key == server.api_key
