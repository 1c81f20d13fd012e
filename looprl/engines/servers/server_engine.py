"""An inference server whose weights looprl reloads between requests: the Engine protocol
over it, shared by the vLLM (vllm.py) and SGLang (sglang.py) engines.

Owns: the server's connection (`ServerClient`), its process when looprl launched it,
the weight folder it loads from, the policy version it serves (and the LoRA adapter,
with model.lora), the generate round trip, and the order of a weight update: write the
folder, pause, load, record the version, resume (unless the caller had paused).
Pausing first drains our requests at the `RequestGate`, then makes the server's own
pause call. A server looprl launched can be started again after it died (`restart`:
same command, new port, the weights of the version it served).

Does not own the HTTP calls that differ between servers: each engine implements the
control calls, `ServerEngine`'s abstract methods (`server_pause`, `server_resume`,
`server_load_weights`, `server_release_memory`, `server_reacquire_memory`, and, where
`loads_adapters`, `server_load_adapter` and `server_unload_adapter`), its generate
request (`request_body`, `generate_path`, `generation`, `check_sampling`) and how it
launches or connects. Nor when to restart (the engine pool decides).

Concurrency contract: `generate` waits at the gate while paused, then reads the version
that every token of that request carries; the version cannot change until the request
is done. `pause` and `resume` take one lock, so they never interleave, and each is a
no-op when already done. Nothing runs in the background.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Self

import torch
from torch import nn

from looprl import adapters
from looprl.config import EngineConfig
from looprl.engines.base import EngineError
from looprl.engines.servers.client import ServerClient
from looprl.engines.servers.process import ServerError, ServerProcess
from looprl.engines.servers.request_gate import RequestGate
from looprl.engines.servers.weight_folder import WeightFolder
from looprl.runs.paths import RunPaths
from looprl.types import FinishReason, Generation, LoraAdapter, SamplingParams

log = logging.getLogger(__name__)

_EXIT_WAIT_S = 5.0  # restart: how long a server that dropped its connections may take to exit

FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class ServerEngine(ABC):
    """The Engine protocol over the server at `client.url`, loading new weights from
    `weights`. An engine states the server's control calls (the abstract methods), its
    generate request (`request_body`, `generate_path`), how it reads a reply
    (`generation`), what sampling it refuses (`check_sampling`), and how it launches
    (`start_process`, then construct) or connects (`attach`).

    `process` is the server's process when looprl launched it, else None;
    `process_for` then gives the process that serves a weight folder (for `restart`).
    """

    kind = "server"  # the server's name in messages ("vLLM", "SGLang")
    generate_path = "/generate"
    # Whether the server loads a LoRA adapter folder by name (`server_load_adapter`);
    # where it cannot, an adapter is merged into the base and loaded as full weights.
    loads_adapters = False

    def __init__(
        self,
        client: ServerClient,
        weights: WeightFolder,
        *,
        process: ServerProcess | None = None,
        process_for: Callable[[Path], ServerProcess] | None = None,
    ) -> None:
        self.client = client
        self.weights = weights
        self.process = process
        self._process_for = process_for
        self._version = 0
        self.adapter: str | None = None  # name of the LoRA adapter requests ask for
        self._gate = RequestGate()
        self._control_lock = asyncio.Lock()
        self._paused = False
        self._released = False

    # The server's control calls, each through `self.client`.

    @abstractmethod
    async def server_pause(self) -> None:
        """Pause the server (our own requests have drained at the gate)."""

    @abstractmethod
    async def server_resume(self) -> None:
        """Let the server generate again."""

    @abstractmethod
    async def server_load_weights(self, path: Path, version: int) -> None:
        """Load the weight folder `path` as `version` (the server is paused)."""

    @abstractmethod
    async def server_release_memory(self) -> None:
        """Free the GPU memory of the weights and KV cache while paused (a collocated
        trainer steps in between)."""

    @abstractmethod
    async def server_reacquire_memory(self) -> None:
        """Take back what `server_release_memory` freed."""

    async def server_load_adapter(self, name: str, path: Path) -> None:
        """Load a LoRA adapter folder under `name`, which requests then ask for, without
        touching the base weights; only called where `loads_adapters`."""
        raise NotImplementedError(f"{type(self).__name__} does not load adapters")

    async def server_unload_adapter(self, name: str) -> None:
        """Drop the adapter `name`; only called where `loads_adapters`."""
        raise NotImplementedError(f"{type(self).__name__} does not load adapters")

    # The generate request.

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Raise EngineError for sampling options this server cannot honour (by default
        none)."""
        return None

    @abstractmethod
    def request_body(self, prompt_ids: list[int], sampling: SamplingParams) -> dict:
        """The JSON body of the generate request."""

    @abstractmethod
    def generation(
        self, reply: dict, prompt_ids: list[int], version: int, top_logprobs: int
    ) -> Generation:
        """The Generation of the server's reply, every token sampled by `version`."""

    # Starting.

    @staticmethod
    def weight_folder(
        cfg: EngineConfig, model: nn.Module, tokenizer, run_dir: Path
    ) -> WeightFolder:
        """Where the server's weight versions go: <run_dir>/weights, in engine.dtype."""
        return WeightFolder.for_model(RunPaths(run_dir).weights, model, tokenizer, cfg.dtype)

    @staticmethod
    async def start_process(
        process_for: Callable[[Path], ServerProcess], weights: WeightFolder, model: nn.Module
    ) -> ServerProcess:
        """Write `model`'s weights as version 0 and start the process `process_for` that
        folder gives, waiting until it is healthy; if it cannot start, delete the weights
        and raise EngineError with its log's tail."""
        model_dir = await asyncio.to_thread(weights.write, model.state_dict(), 0)
        process = process_for(model_dir)
        try:
            await asyncio.to_thread(process.start)
        except ServerError as e:
            weights.remove()
            raise EngineError(str(e)) from e
        return process

    @classmethod
    async def attach(
        cls, client: ServerClient, weights: WeightFolder, model: nn.Module, **kwargs
    ) -> Self:
        """The engine of a server already running at `client.url` (`kwargs`: the
        engine's own arguments), `model`'s weights loaded into it as version 0 (so it may
        have started from any checkpoint of the architecture)."""
        engine = cls(client, weights, **kwargs)
        await engine.update_weights(model.state_dict(), 0)
        return engine

    @property
    def version(self) -> int:
        return self._version

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def launched(self) -> bool:
        """Whether looprl launched the server, and so can `restart` it."""
        return self.process is not None

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, session: str | None = None
    ) -> Generation:
        """Sample a continuation; waits while a weight reload is under way. `session` is
        not used: the server's own prefix cache finds shared prefixes."""
        if not prompt_ids:
            raise EngineError("prompt_ids is empty; the engine needs at least one prompt token")
        self.check_sampling(sampling)
        async with self._gate.request():
            version = self._version
            reply = await self.client.post(
                self.generate_path, self.request_body(prompt_ids, sampling)
            )
        return self.generation(reply, list(prompt_ids), version, sampling.top_logprobs)

    def finish_reason(self, reason: str, detail: object) -> FinishReason:
        """The Generation's finish reason for the server's; an unknown one is an error."""
        known = FINISH_REASONS.get(reason)
        if known is None:
            raise EngineError(
                f"the {self.kind} server at {self.url} ended a generation with finish_reason="
                f"{detail!r}; looprl knows {sorted(FINISH_REASONS)}"
            )
        return known

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Write `state_dict` as `version`, then load it in the server between requests."""
        path = await asyncio.to_thread(self.weights.write, state_dict, version)
        was_paused = self._paused
        await self.pause()
        try:
            await self.reacquire_memory()
            await self.server_load_weights(path, version)
            self._version = version
            if self.adapter is not None:  # full weights replace base + adapter
                previous, self.adapter = self.adapter, None
                await self.server_unload_adapter(previous)
        finally:
            if not was_paused:
                await self.resume()

    async def update_adapter(self, adapter: LoraAdapter, version: int) -> None:
        """Serve the base weights with `adapter` as `version`: its folder loaded by name
        (the base stays; the previous adapter is dropped once requests ask for the new
        one), or, where the server cannot load adapters, merged into the newest full
        version and loaded as weights."""
        if not self.loads_adapters:
            merged = adapters.merge(await asyncio.to_thread(self.weights.read_base), adapter)
            await self.update_weights(merged, version)
            return
        path = await asyncio.to_thread(self.weights.write_adapter, adapter, version)
        name = f"{path.name}"
        was_paused = self._paused
        await self.pause()
        try:
            await self.reacquire_memory()
            await self.server_load_adapter(name, path)
            previous, self.adapter, self._version = self.adapter, name, version
            if previous is not None and previous != name:
                await self.server_unload_adapter(previous)
        finally:
            if not was_paused:
                await self.resume()

    async def pause(self) -> None:
        """Let our requests in flight finish, hold new ones, and pause the server."""
        async with self._control_lock:
            if self._paused:
                return
            await self._gate.close()
            try:
                await self.server_pause()
            except EngineError:
                self._gate.open()
                raise
            self._paused = True

    async def release_memory(self) -> None:
        """While paused: free the server's GPU memory (weights, KV cache) for a trainer
        collocated on its GPUs; the next weight load or resume takes it back."""
        async with self._control_lock:
            if self._released:
                return
            if not self._paused:
                raise EngineError("release_memory needs the server paused first")
            await self.server_release_memory()
            self._released = True

    async def reacquire_memory(self) -> None:
        """Take back what `release_memory` freed; a no-op when nothing was released."""
        async with self._control_lock:
            if not self._released:
                return
            await self.server_reacquire_memory()
            self._released = False

    async def resume(self) -> None:
        await self.reacquire_memory()
        async with self._control_lock:
            if not self._paused:
                return
            await self.server_resume()
            self._paused = False
            self._gate.open()

    async def restart(self) -> None:
        """Start the server looprl launched again, after it died or stopped answering:
        what is left of it is stopped, its log kept beside the new one's, and the same
        command runs on a new port, serving the weight folder of the version it served
        (the version stays). It comes back not paused. EngineError when looprl did not
        launch it or it cannot start."""
        if self._process_for is None:
            raise EngineError(
                f"the {self.client.name} at {self.client.url} was not launched by looprl "
                "(engine.url), so looprl cannot restart it; restart it where it runs"
            )
        # With an adapter loaded, the base it adapts (the newest full version) starts,
        # and the adapter is loaded again.
        versions = self.weights.versions()
        base = versions[-1] if self.adapter is not None and versions else self._version
        model_dir = self.weights.path(base)
        if not model_dir.is_dir():
            raise EngineError(
                f"cannot restart the {self.client.name}: the weights of version "
                f"{self._version} it served are gone from {model_dir}"
            )
        async with self._control_lock:
            dead, pid = self.process, self.process.pid
            # A connection can drop a moment before the process is gone: give it that moment.
            how = _exit(await asyncio.to_thread(dead.exit_code, _EXIT_WAIT_S))
            await self.client.close()
            await asyncio.to_thread(dead.stop)
            kept = _keep_log(dead.log_path)
            process = self._process_for(model_dir)
            log.warning(
                "The %s (pid %s, %s) %s; starting it again on %s, serving %s (policy version %d)%s",
                dead.name,
                pid,
                dead.url,
                how,
                process.url,
                model_dir,
                self._version,
                f"; the dead server's log is kept as {kept}" if kept else "",
            )
            self.process = process
            try:
                await asyncio.to_thread(process.start)
            except ServerError as e:
                raise EngineError(str(e)) from e
            except asyncio.CancelledError:  # the thread goes on: end what it started
                await asyncio.to_thread(process.stop)
                raise
            self.client = launched_client(process)
            self._paused = self._released = False
            if self.adapter is not None:
                path = self.weights.adapter_path(self._version)
                await self.server_load_adapter(self.adapter, path)
            self._gate.open()

    async def stop(self) -> None:
        """Close the connection, stop the server looprl launched, delete the weights."""
        await self.client.close()
        if self.process is not None:
            await asyncio.to_thread(self.process.stop)
        self.weights.remove()


def launched_client(process: ServerProcess) -> ServerClient:
    """The connection to a server looprl launched."""
    return ServerClient(process.url, name=process.name, process=process)


def server_python(cfg: EngineConfig, default_venv: str, install: str) -> Path:
    """The python of engine.venv (default `default_venv`); EngineError saying how to
    create it (`install`: the pip command) when it has none."""
    venv = Path(cfg.venv or default_venv)
    python = venv / "bin" / "python"
    if not python.exists():
        raise EngineError(
            f"engine.venv={str(venv)!r} has no bin/python; create it (`python -m venv {venv} "
            f"&& {venv}/bin/{install}`) or point engine.venv at one"
        )
    return python


def _exit(code: int | None) -> str:
    """How a server's process ended, in words."""
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:  # a real-time signal has no name
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _keep_log(path: Path) -> Path | None:
    """Move a dead server's log aside (vllm-0.log -> vllm-0.died-1.log, -2, ...), so the
    new server's log does not overwrite it."""
    if not path.exists():
        return None
    n = 1
    while (kept := path.with_name(f"{path.stem}.died-{n}{path.suffix}")).exists():
        n += 1
    path.rename(kept)
    return kept
