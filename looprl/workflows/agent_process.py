"""Agents in another process or language: `workflow.mode=subprocess`.

Owns `AgentProcess`, a Workflow that runs one command per rollout. The command gets
the rollout's endpoint the way every OpenAI client reads it, and the dataset row:

    OPENAI_BASE_URL   the session's base URL (.../sessions/{id}/v1)
    OPENAI_API_KEY    the session's key
    OPENAI_MODEL      the model name to send
    LOOPRL_REWARD_URL where to POST {"reward": 1.0} (or per-call rewards; see the gateway)
    LOOPRL_DATA       the dataset row as JSON, also written to its stdin

It posts its reward over HTTP and exits 0. A non-zero exit fails the rollout with
`AgentProcessError` holding the last lines of its stderr; exiting without posting a
reward rejects the rollout (as a Python workflow returning None does). When the
rollout times out (`rollout.timeout_s`) or the run stops, the command's whole process
group gets SIGTERM, then SIGKILL after `kill_grace_s`, and the rollout counts as timed
out. Knows nothing of training; the controller counts what failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
from typing import Any

STDERR_TAIL_LINES = 20


class AgentProcessError(RuntimeError):
    """The agent command could not start or exited with a non-zero code."""


class AgentProcess:
    def __init__(
        self,
        command: str | list[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        kill_grace_s: float = 2.0,
    ):
        self.command = shlex.split(command) if isinstance(command, str) else list(command)
        if not self.command:
            raise ValueError("workflow.command is empty: give the agent's command line")
        self.env = dict(env or {})
        self.cwd = cwd
        self.kill_grace_s = kill_grace_s

    def __repr__(self) -> str:
        return f"agent command {shlex.join(self.command)}"

    async def run(self, data: dict, *, base_url: str, api_key: str, model: str, **kw: Any):
        row = json.dumps(data)
        env = {
            **os.environ,
            **self.env,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": api_key,
            "OPENAI_MODEL": model,
            "LOOPRL_REWARD_URL": base_url.rstrip("/").removesuffix("/v1") + "/reward",
            "LOOPRL_DATA": row,
        }
        try:
            process = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                cwd=self.cwd,
                start_new_session=True,  # its own process group: a kill reaches its children
            )
        except OSError as e:
            raise AgentProcessError(f"cannot start {self!r}: {e}") from e
        try:
            _, stderr = await process.communicate(row.encode())
        except BaseException:  # cancelled: the rollout timed out or the run is stopping
            await self._kill(process)
            raise
        if process.returncode != 0:
            lines = stderr.decode(errors="replace").rstrip().splitlines()[-STDERR_TAIL_LINES:]
            tail = "\n".join(lines) or "(nothing on stderr)"
            raise AgentProcessError(
                f"{self!r} exited with code {process.returncode}; its stderr ends with:\n{tail}"
            )
        return None  # the reward was posted to LOOPRL_REWARD_URL (or the rollout is rejected)

    async def _kill(self, process: asyncio.subprocess.Process) -> None:
        """SIGTERM the process group, SIGKILL it after the grace period, reap the process."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            try:
                await asyncio.wait_for(asyncio.shield(process.wait()), self.kill_grace_s)
                return
            except TimeoutError:
                continue
