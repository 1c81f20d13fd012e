"""Environments in worker processes, so that a slow or crashing one never blocks the
event loop (the gateway, the engine's batching, other rollouts).

Owns: `EnvWorkers`, a fixed pool of `n_workers` processes (multiprocessing, spawn
context), and `Episode`, one episode's handle. Each worker holds the environments of the
episodes assigned to it (the least loaded worker takes a new episode) and serves one
call at a time; messages are JSON over a pipe both ways (nothing from a worker is
unpickled).

Failures end only the episode that caused them, and are counted (`counts`):

- the env raises (other than InvalidAction) or breaks the contract: EnvFailed; the worker
  drops that env and goes on;
- the worker dies during a call: EnvCrashed; a call runs past `step_timeout_s`: the
  worker is killed, EnvTimedOut. Either way a new worker takes its place, and each other
  episode it held is rebuilt there on its next call by replaying its seed and actions;
  an episode whose replay does not give back the observations it saw (the env is not
  deterministic) ends with EnvCrashed.

Frames (`max_frames` > 0, env.frames_every): the envs are built with
render_mode="rgb_array" (and MUJOCO_GL set as looprl/diagnostics/rendering.py picks it,
unless the user set it), an episode reset with `record=True` renders after its reset
and each step (looprl/envs/frames.py), and `Episode.save_frames(path)` has its worker
write them as a GIF. A render that fails stops that worker's rendering; it is logged once
with `looprl doctor`'s diagnosis, and every recorded episode without frames is counted
(`counts["frames_failed"]`), never raised: the episodes go on.

Concurrency contract: all calls come from one event loop. A worker's lock is held for
one request and its reply (and a replay before it). Reading a reply never blocks the
loop: the loop's reader says when the socket has bytes, and only what is there is taken
(non-blocking), so a reply arriving in pieces is put together across wake-ups; a call
cancelled meanwhile leaves its reply to be read and dropped before the next request.
Each worker is a session leader (its own process group): a restart and `close()`
(synchronous) signal the whole group, the env's own children included. Every wait is
bounded: a stopped worker gets `STOP_GRACE_S` to exit on its closed socket, then SIGTERM
and as long again, then SIGKILL and `KILL_WAIT_S`; one that outlives even that is logged
and left. A worker kills its own group when its socket closes (stopped, or looprl's
process is gone) or its parent process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from looprl.diagnostics import rendering
from looprl.envs.base import (
    EnvCrashed,
    EnvError,
    EnvFailed,
    EnvTimedOut,
    InvalidAction,
    StepResult,
    make_env,
)
from looprl.envs.frames import EpisodeFrames

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # spawning a worker and building one env (imports included)
STOP_GRACE_S = 1.0  # a stopped worker's time to exit on its closed socket, then on SIGTERM
KILL_WAIT_S = 5.0  # how long a SIGKILLed worker is waited for before it is left
READ_BYTES = 1 << 16  # taken off a worker's socket per read
# Connection.send_bytes' framing, which a worker's replies use: a 4-byte big-endian
# length, or -1 and then an 8-byte one (2 GiB and over).
_LENGTH, _LONG_LENGTH = struct.Struct("!i"), struct.Struct("!Q")


class EnvWorkers:
    """`n_workers` processes playing `make_env(name, kwargs)` episodes."""

    def __init__(
        self,
        name: str,
        kwargs: dict[str, Any],
        n_workers: int,
        step_timeout_s: float,
        max_frames: int = 0,
    ) -> None:
        self.name, self.kwargs = name, dict(kwargs)
        self.step_timeout_s = step_timeout_s
        self.max_frames = max_frames  # frames kept per recorded episode; 0: no rendering
        # crashed, timed_out, failed, restarts; frames_saved (episodes), frames_dropped
        # (frames past max_frames), frames_failed (recorded episodes left without frames)
        self.counts: Counter[str] = Counter()
        self._ids = itertools.count()
        self._workers = [_Worker(self, i) for i in range(n_workers)]

    def start(self) -> None:
        """Start every worker and wait until each has built one env; raises ValueError
        naming env.name when it cannot be built (so a typo fails the run at start)."""
        try:
            for worker in self._workers:
                worker.spawn()
            for worker in self._workers:
                worker.wait_ready()
        except BaseException:
            self.close()
            raise

    @contextlib.asynccontextmanager
    async def episode(self) -> AsyncIterator[Episode]:
        """An episode on the least loaded worker; its env is dropped on exit."""
        worker = min(self._workers, key=lambda w: len(w.episodes))
        episode = Episode(worker, f"e{next(self._ids)}")
        worker.episodes.add(episode.id)
        try:
            yield episode
        finally:
            worker.episodes.discard(episode.id)
            await worker.drop(episode)

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w.process is not None]

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        recorded = self.counts["frames_saved"] + self.counts["frames_failed"]
        if recorded and any(w.process is not None for w in self._workers):
            log.info(
                "env %s: frames of %d episodes saved, %d frames dropped past "
                "env.frames_max_per_episode, %d recorded episodes left without frames",
                self.name,
                self.counts["frames_saved"],
                self.counts["frames_dropped"],
                self.counts["frames_failed"],
            )
        for worker in self._workers:
            worker.stop()

    def _count(self, kind: str, error: EnvError) -> None:
        if not self.counts[kind]:
            log.warning(
                "env %s: an episode ended with %s: %s (later ones are counted in the "
                "rollout stats' errors)",
                self.name,
                type(error).__name__,
                error,
            )
        self.counts[kind] += 1

    def _count_frames(self, reply: dict) -> int:
        """Count one recorded episode's frames (the worker's reply to "frames")."""
        if "failed" in reply:
            if not self.counts["frames_failed"]:
                diagnosis = reply.get("diagnosis")
                log.warning(
                    "env %s: an episode's frames were not saved (%s), so episodes go on "
                    "without them; later ones are counted as frames_failed.%s",
                    self.name,
                    reply["failed"],
                    f" looprl doctor says: {diagnosis}" if diagnosis else "",
                )
            self.counts["frames_failed"] += 1
            return 0
        self.counts["frames_saved"] += 1
        self.counts["frames_dropped"] += reply["dropped"]
        return reply["frames"]


class Episode:
    """One episode's calls. It remembers its seed and actions, so that a worker restarted
    under it can rebuild its env by replaying them."""

    def __init__(self, worker: _Worker, episode_id: str) -> None:
        self.worker, self.id = worker, episode_id
        self.generation = -1  # the worker generation holding this episode's env
        self.seed: int | None = None
        self.options: dict | None = None
        self.record = False  # whether its frames are recorded (for save_frames)
        self.played: list[tuple[str, str]] = []  # (action, observation) accepted so far

    async def reset(self, seed: int, options: dict | None = None, record: bool = False) -> str:
        """Start the episode; `record` renders its frames (the pool's max_frames > 0)."""
        self.seed, self.options, self.played = seed, options, []
        self.record = record and self.worker.pool.max_frames > 0
        message = {"op": "reset", "seed": seed, "options": options, "record": self.record}
        reply = await self.worker.call(self, message)
        return reply["observation"]

    async def step(self, action_text: str) -> StepResult:
        if self.seed is None:
            raise EnvFailed("step() before reset(): an episode starts with reset(seed)")
        reply = await self.worker.call(self, {"op": "step", "action": action_text})
        self.played.append((action_text, reply["observation"]))
        return reply["observation"], reply["reward"], reply["done"], reply["info"]

    async def save_frames(self, path: Path) -> int:
        """Write the frames recorded since `reset(record=True)` to `path` (a GIF); returns
        how many. A failure (rendering, the write, the worker) is counted, never raised."""
        try:
            reply = await self.worker.call(self, {"op": "frames", "path": str(path)})
        except EnvError as e:
            reply = {"failed": f"{type(e).__name__}: {e}"}
        return self.worker.pool._count_frames(reply)


class _Worker:
    def __init__(self, pool: EnvWorkers, index: int) -> None:
        self.pool, self.index = pool, index
        self.process: multiprocessing.process.BaseProcess | None = None
        self.sock: socket.socket | None = None  # our end; the worker's is a Connection
        self.received = bytearray()  # read off the socket, not yet taken as messages
        self.generation = 0  # + 1 per restart: episodes held before must replay
        self.episodes: set[str] = set()
        self.lock = asyncio.Lock()
        self.starting = False
        self.unread = 0

    def spawn(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.sock, theirs = socket.socketpair()  # what context.Pipe() is made of
        child = multiprocessing.connection.Connection(theirs.detach())
        self.received = bytearray()
        self.process = context.Process(
            target=serve,
            args=(
                child,
                self.pool.name,
                json.dumps(self.pool.kwargs),
                os.getpid(),
                self.pool.max_frames,
            ),
            name=f"looprl-env-{self.index}",
            daemon=True,
        )
        self.process.start()
        child.close()

    def wait_ready(self) -> None:
        """Block until the worker has built its env (start-up, before the loop serves)."""
        try:
            reply = self._next_message_now(START_TIMEOUT_S)
        except (EOFError, OSError):
            _exited(self.process, 1.0)
            code = self.stop()
            raise ValueError(
                f"env.name={self.pool.name!r}: its worker died while building the env "
                f"(exit code {code}; a script that starts training needs `if __name__ == "
                "'__main__':`, since workers are spawned and import the main module)"
            ) from None
        if reply is None:
            self.stop()
            raise ValueError(
                f"env.name={self.pool.name!r}: a worker did not build the env within "
                f"{START_TIMEOUT_S:g} s"
            )
        if "error" in reply:
            self.stop()
            raise ValueError(
                f"env.name={self.pool.name!r} with env.kwargs={self.pool.kwargs} could not "
                f"be built: {reply['error']}"
            )

    async def call(self, episode: Episode, message: dict) -> dict:
        async with self.lock:
            replay = episode.generation != self.generation and message["op"] != "reset"
            episode.generation = self.generation
            if replay:
                await self._replay(episode)
            return await self._request({**message, "episode": episode.id})

    async def drop(self, episode: Episode) -> None:
        async with self.lock:
            if episode.generation != self.generation or self.process is None:
                return  # its env died with an earlier worker, or with the pool
            with contextlib.suppress(EnvError):
                await self._request({"op": "drop", "episode": episode.id})

    async def _replay(self, episode: Episode) -> None:
        """Rebuild `episode`'s env on this (restarted) worker from its seed and actions."""
        reset = {
            "op": "reset",
            "seed": episode.seed,
            "options": episode.options,
            "record": episode.record,
        }
        try:
            await self._request({**reset, "episode": episode.id})
            seen = []
            for action, _ in episode.played:
                step = {"op": "step", "action": action, "episode": episode.id}
                seen.append((await self._request(step))["observation"])
        except (EnvError, InvalidAction) as e:
            raise EnvCrashed(
                f"its worker was restarted and the episode could not be rebuilt: {e}"
            ) from e
        if seen != [observation for _, observation in episode.played]:
            error = EnvCrashed(
                "its worker was restarted and replaying the episode's actions gave other "
                "observations than before (the env is not deterministic in its seed)"
            )
            self.pool._count("crashed", error)
            raise error

    async def _request(self, message: dict) -> dict:
        """Send one request and await its reply; a death or a timeout restarts the worker."""
        if self.process is None:
            raise EnvCrashed(f"the workers of env {self.pool.name} were closed")
        while self.unread:  # replies to calls whose episode was cancelled meanwhile
            if await self._receive(message, self.pool.step_timeout_s) is None:
                self._restart()
                break
            self.unread -= 1
        if self.starting:  # a restarted worker first says it has built its env
            ready = await self._receive(message, START_TIMEOUT_S)
            if ready is None:
                self._restart()
                raise EnvCrashed(f"a restarted worker of env {self.pool.name} did not start")
            self.starting = False
            if "error" in ready:
                raise EnvCrashed(
                    f"a restarted worker could not build env {self.pool.name}: {ready['error']}"
                )
        body = json.dumps(message).encode()
        try:  # blocking, but the worker is idle and reading: it drains as we write
            self.sock.sendall(_LENGTH.pack(len(body)) + body)
        except OSError:
            raise self._crashed(message) from None
        try:
            reply = await self._receive(message, self.pool.step_timeout_s)
        except asyncio.CancelledError:  # the rollout was cancelled: its reply comes later
            self.unread += 1
            raise
        if reply is None:
            self._restart()
            error = EnvTimedOut(
                f"{message['op']}() of env {self.pool.name} ran past env.step_timeout_s="
                f"{self.pool.step_timeout_s:g}; its worker was killed"
            )
            self.pool._count("timed_out", error)
            raise error
        if "invalid" in reply:
            raise InvalidAction(reply["invalid"])
        if "error" in reply:
            error = EnvFailed(f"env {self.pool.name}: {reply['error']}")
            self.pool._count("failed", error)
            raise error
        return reply

    async def _receive(self, message: dict, timeout_s: float) -> dict | None:
        """The worker's next message, or None when none is whole within timeout_s;
        EnvCrashed (and a restart) when it died instead."""
        try:
            return await self._next_message(timeout_s)
        except (EOFError, OSError):
            raise self._crashed(message) from None

    async def _next_message(self, timeout_s: float) -> dict | None:
        """Read what the socket holds until a message is whole, for up to timeout_s;
        cancelled meanwhile, nothing read is lost."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (message := self._take_message()) is None:
            left = deadline - loop.time()
            if left <= 0 or not await self._readable(left):
                return None
            self._read_some()
        return message

    def _next_message_now(self, timeout_s: float) -> dict | None:
        """`_next_message`, blocking: for start(), which runs before the loop serves."""
        deadline = time.monotonic() + timeout_s
        while (message := self._take_message()) is None:
            left = deadline - time.monotonic()
            if left <= 0 or not multiprocessing.connection.wait([self.sock], left):
                return None
            self._read_some()
        return message

    async def _readable(self, timeout_s: float) -> bool:
        """Wait until the socket has data (or the worker's end closed) for up to timeout_s."""
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = self.sock.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await asyncio.wait_for(readable, timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(fd)

    def _read_some(self) -> None:
        """Take what the socket holds now, without waiting; EOFError when the worker's
        end is closed (it died)."""
        try:
            chunk = self.sock.recv(READ_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return  # woken with nothing to read after all
        if not chunk:
            raise EOFError
        self.received += chunk

    def _take_message(self) -> dict | None:
        """The first whole message read so far, taken off `received`; None if none is."""
        if len(self.received) < _LENGTH.size:
            return None
        (size,) = _LENGTH.unpack_from(self.received)
        start = _LENGTH.size
        if size == -1:
            start += _LONG_LENGTH.size
            if len(self.received) < start:
                return None
            (size,) = _LONG_LENGTH.unpack_from(self.received, _LENGTH.size)
        if len(self.received) < start + size:
            return None
        body = bytes(self.received[start : start + size])
        del self.received[: start + size]
        return json.loads(body)

    def _crashed(self, message: dict) -> EnvCrashed:
        """Restart the worker found dead during `message`; the error to raise, counted."""
        _exited(self.process, 1.0)  # it is exiting: its own exit code, not our SIGKILL's
        code = self._restart()
        error = EnvCrashed(
            f"the worker running env {self.pool.name} died during {message['op']}() "
            f"(exit code {code})"
        )
        self.pool._count("crashed", error)
        return error

    def _restart(self) -> int | None:
        """Replace the worker (it hung or died: no grace); the old one's exit code."""
        code = self.stop(grace_s=0.0)
        self.generation += 1
        self.unread = 0
        self.pool.counts["restarts"] += 1
        self.spawn()
        self.starting = True  # its ready message is read before the next request
        return code

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """Close the socket (an idle worker exits on it), then SIGTERM the worker's process
        group, then SIGKILL it (the worker and whatever it started), each wait bounded;
        the worker's exit code (None: it did not end and was left)."""
        process, self.process = self.process, None
        if process is None:
            return None
        self.sock.close()
        if grace_s and not _exited(process, grace_s):
            _signal(process, signal.SIGTERM)
            _exited(process, grace_s)
        _signal(process, signal.SIGKILL)  # also when it exited: what it started may live on
        process.join(KILL_WAIT_S)
        code = process.exitcode
        if code is None:
            log.warning(
                "env %s: worker %d (pid %d) did not end within %g s of SIGKILL; leaving it",
                self.pool.name,
                self.index,
                process.pid,
                KILL_WAIT_S,
            )
            return None
        process.close()
        return code


def _exited(process: multiprocessing.process.BaseProcess, timeout_s: float) -> bool:
    """Wait up to timeout_s for `process` to exit, without reaping it (so that its pid,
    its process group's id, is not reused while the group is signalled)."""
    return bool(multiprocessing.connection.wait([process.sentinel], timeout_s))


def _signal(process: multiprocessing.process.BaseProcess, sig: int) -> None:
    """`sig` to the worker's process group, and to the worker itself (killed before it
    made its group, it is in ours)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)
    if sig == signal.SIGKILL:
        process.kill()
    else:
        process.terminate()


def serve(conn, name: str, kwargs_json: str, parent_pid: int, max_frames: int = 0) -> None:
    """A worker's main loop: build one env (the start check), then answer requests."""
    os.setsid()  # a process group of its own, so that stopping it reaches its children
    os.set_inheritable(conn.fileno(), False)  # a child of the env's cannot hide our death
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    kwargs = json.loads(kwargs_json)
    if max_frames:  # the envs render (Gymnasium's convention), headless
        rendering.use_headless_rendering()
        kwargs["render_mode"] = "rgb_array"
    frames = EpisodeFrames(max_frames)
    loop = asyncio.new_event_loop()  # for envs whose methods are async

    def call(fn, *args):
        result = fn(*args)
        return loop.run_until_complete(result) if inspect.isawaitable(result) else result

    def send(reply: dict) -> None:
        conn.send_bytes(json.dumps(reply, default=str).encode())

    envs: dict[str, Any] = {}
    try:
        make_env(name, kwargs)
    except Exception as e:
        send({"error": f"{type(e).__name__}: {e}{_rendering_hint(max_frames)}"})
        return
    send({"ready": True})
    while True:
        try:
            message = json.loads(conn.recv_bytes())
        except (EOFError, OSError):  # stopped, or looprl is gone: so is what the envs started
            _kill_own_group()
        episode, op = message["episode"], message["op"]
        try:
            if op == "reset":
                envs[episode] = env = envs.get(episode) or make_env(name, kwargs)
                observation = call(env.reset, message["seed"], message["options"])
                frames.start(episode, env, message.get("record", False))
                send({"observation": _text(observation, "reset()")})
            elif op == "step":
                reply = _step_reply(call(envs[episode].step, message["action"]))
                frames.capture(episode, envs[episode])
                send(reply)
            elif op == "frames":
                send(frames.save(episode, message["path"]))
            else:  # drop
                envs.pop(episode, None)
                frames.drop(episode)
                send({})
        except InvalidAction as e:
            send({"invalid": str(e)})
        except Exception as e:
            envs.pop(episode, None)  # in an unknown state
            send({"error": f"{type(e).__name__}: {e}"})


def _rendering_hint(max_frames: int) -> str:
    """What to add to an env's build error about rendering: how frames build it, and the
    rendering checks of `looprl doctor` that fail here (a MUJOCO_GL without its library
    breaks `import mujoco`)."""
    hint = " (env.frames_every > 0 builds it with render_mode='rgb_array')" if max_frames else ""
    diagnosis = rendering.diagnose(failures_only=True)
    return hint + (f"; looprl doctor says: {diagnosis}" if diagnosis else "")


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where} must return the observation as text, got {type(value).__name__}")
    return value


def _step_reply(result: Any) -> dict:
    if not isinstance(result, tuple) or len(result) != 4:
        raise TypeError(
            "step() must return (observation: str, reward: float, done: bool, info: dict), "
            f"got {type(result).__name__} {str(result)[:80]!r} (a Gymnasium env: use "
            "env.name=gymnasium:ID)"
        )
    observation, reward, done, info = result
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise TypeError(f"step()'s reward must be a number, got {type(reward).__name__}")
    if not math.isfinite(reward):
        raise ValueError(f"step() returned a non-finite reward {reward!r}")
    if not isinstance(info, dict):
        raise TypeError(f"step()'s info must be a dict, got {type(info).__name__}")
    return {
        "observation": _text(observation, "step()"),
        "reward": float(reward),
        "done": bool(done),
        "info": info,
    }


def _exit_with_parent(parent_pid: int) -> None:
    """End this worker and what its envs started once its parent is gone, even while an
    env call hangs."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    _kill_own_group()


def _kill_own_group() -> None:
    """SIGKILL this worker's process group (serve() made it its own): the worker and
    whatever its envs started."""
    os.killpg(0, signal.SIGKILL)
