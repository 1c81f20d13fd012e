"""Agents in another process or language: `workflow.mode=subprocess`.

Owns `AgentProcess`, a Workflow that runs one command per rollout. Of looprl's own
environment the command gets only what a program needs to run (`INHERITED`: PATH,
HOME, LANG, LC_*, TMPDIR, PYTHONPATH, those that are set) and the variables named in
workflow.env_passthrough, never the run's tracker, hub or engine keys. Then `env`
(workflow.kwargs.env), then the rollout's endpoint the way every OpenAI client reads it,
and the dataset row:

    OPENAI_BASE_URL   the session's base URL (.../sessions/{id}/v1)
    OPENAI_API_KEY    the session's key for model calls
    OPENAI_MODEL      the model name to send
    ANTHROPIC_BASE_URL the same session for Anthropic's clients (without `/v1`, which
                      they add), and ANTHROPIC_API_KEY its key
    LOOPRL_REWARD_URL where to POST {"reward": 1.0} (or per-call rewards; see the gateway)
    LOOPRL_REWARD_KEY the key that POST needs (Bearer); OPENAI_API_KEY cannot post one
    LOOPRL_DATA       the dataset row as JSON, also written to its stdin

(LOOPRL_REWARD_* only for a gateway session, not for `looprl debug workflow` against
another server.) The reward key is the agent's: whatever holds it can set the rollout's
reward. An agent that runs the model's tool calls must run them without it: pop it from
its own environment before starting anything, and run the calls in a sandbox with an
empty environment and no route to the gateway (as looprl's code sandbox is). looprl
cannot see inside the agent; what it ensures is that the key the model's calls go
through (OPENAI_API_KEY) posts no reward, and that both keys die with the session.

It posts its reward over HTTP and exits 0. A non-zero exit fails the rollout with
`AgentProcessError` holding the last lines of its stderr (only the last
`STDERR_TAIL_BYTES` are kept as it runs, however much it writes); exiting without
posting a reward rejects the rollout (as a Python workflow returning None does).

The command runs in a process group of its own, which gets SIGTERM, then SIGKILL after
`kill_grace_s`, however the rollout ends: the command exited (what it started and left
running dies with it), the rollout timed out (`rollout.timeout_s`; it counts as timed
out), or the run is stopping. What escapes a process-group kill: a process that left the
group (setsid, setpgid: a daemon's double fork) and what other services start for it
(a container daemon's containers). Knows nothing of training; the controller counts what
failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import signal
from typing import Any

log = logging.getLogger(__name__)

# Of looprl's environment, what every agent gets (where set), besides every LC_*.
INHERITED = ("PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH")
STDERR_TAIL_BYTES = 64 * 1024  # kept of the command's stderr: its last bytes
STDERR_TAIL_LINES = 20  # of those, what a failure reports
GROUP_POLL_S = 0.05  # how often a signalled process group is checked for being gone


class AgentProcessError(RuntimeError):
    """The agent command could not start or exited with a non-zero code."""


class AgentProcess:
    def __init__(
        self,
        command: str | list[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        kill_grace_s: float = 2.0,
        env_passthrough: list[str] | None = None,
    ):
        self.command = shlex.split(command) if isinstance(command, str) else list(command)
        if not self.command:
            raise ValueError("workflow.command is empty: give the agent's command line")
        self.env = dict(env or {})
        self.cwd = cwd
        self.kill_grace_s = kill_grace_s
        self.env_passthrough = list(env_passthrough or [])
        unset = [name for name in self.env_passthrough if name not in os.environ]
        if unset:
            log.warning(
                "workflow.env_passthrough names %s, not set in looprl's environment: the "
                "agent runs without %s",
                ", ".join(unset),
                "it" if len(unset) == 1 else "them",
            )

    def __repr__(self) -> str:
        return f"agent command {shlex.join(self.command)}"

    def inherited_env(self) -> dict[str, str]:
        """What the command gets of looprl's environment now: INHERITED, every LC_* and
        workflow.env_passthrough, those that are set."""
        names = [*INHERITED, *(n for n in os.environ if n.startswith("LC_")), *self.env_passthrough]
        return {name: os.environ[name] for name in names if name in os.environ}

    async def run(
        self,
        data: dict,
        *,
        base_url: str,
        api_key: str,
        model: str,
        reward_key: str | None = None,
        **kw: Any,
    ):
        row = json.dumps(data)
        env = {
            **self.inherited_env(),
            **self.env,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": api_key,
            "OPENAI_MODEL": model,
            "ANTHROPIC_BASE_URL": base_url.rstrip("/").removesuffix("/v1"),
            "ANTHROPIC_API_KEY": api_key,
            "LOOPRL_DATA": row,
        }
        if reward_key is not None:
            env["LOOPRL_REWARD_URL"] = base_url.rstrip("/").removesuffix("/v1") + "/reward"
            env["LOOPRL_REWARD_KEY"] = reward_key
        loop = asyncio.get_running_loop()
        try:
            transport, pipes = await loop.subprocess_exec(
                lambda: _Pipes(STDERR_TAIL_BYTES),
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
            stdin = transport.get_pipe_transport(0)
            stdin.write(row.encode())  # buffered by the transport: a command may not read it
            stdin.close()
            await asyncio.shield(pipes.exited)
        finally:  # exited, timed out or cancelled: its group goes, whatever is left of it
            ending = asyncio.ensure_future(self._end(transport, pipes))
            await asyncio.shield(ending)  # cancelled again, the kill still runs to its end
        code = transport.get_returncode()
        if code != 0:
            lines = pipes.stderr.decode(errors="replace").rstrip().splitlines()
            tail = "\n".join(lines[-STDERR_TAIL_LINES:]) or "(nothing on stderr)"
            raise AgentProcessError(
                f"{self!r} exited with code {code}; its stderr ends with:\n{tail}"
            )
        return None  # the reward was posted to LOOPRL_REWARD_URL (or the rollout is rejected)

    async def _end(self, transport: asyncio.SubprocessTransport, pipes: _Pipes) -> None:
        """SIGTERM the command's process group, SIGKILL what is left of it after the grace
        period; then the command's exit and the rest of its stderr, each awaited for at most
        the grace period (a process that escaped the group may hold the pipe), and its
        pipes closed."""
        loop = asyncio.get_running_loop()
        group = transport.get_pid()
        try:
            os.killpg(group, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone (the usual end of a clean exit), or is not ours to kill
        else:
            deadline = loop.time() + self.kill_grace_s
            while _group_exists(group) and loop.time() < deadline:
                await asyncio.sleep(GROUP_POLL_S)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        for done in (pipes.exited, pipes.stderr_closed):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(done), self.kill_grace_s)
        transport.close()


class _Pipes(asyncio.SubprocessProtocol):
    """The command's end of things: the last `limit` bytes of its stderr, and futures for
    its exit (reaped) and for its stderr's end."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.stderr = bytearray()
        loop = asyncio.get_running_loop()
        self.exited = loop.create_future()
        self.stderr_closed = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.stderr += data  # fd 2: stdout is /dev/null
        del self.stderr[: -self.limit]

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd == 2 and not self.stderr_closed.done():
            self.stderr_closed.set_result(None)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)


def _group_exists(pgid: int) -> bool:
    """Whether process group `pgid` has a member (an exited one not yet reaped counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member runs as another user: it exists
        pass
    return True
