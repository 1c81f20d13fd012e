"""The in-process PyTorch inference engine, with continuous batching.

Owns: a private copy of a Hugging Face causal LM in the engine's dtype, the queue of
waiting requests, the running batch and each request's sampling state (the sampler
itself is `sampling.py`). Its model runner (`runners.py`) owns the forward and the KV
cache: the fused forward with preallocated KV slots for Llama-family models (`fused.py`,
with the kernels start-up chose: "cpu", tuned for CPUs, or "portable", plain torch
that is right on any device, the GPU default), the Hugging Face forward for any other.
Does not own tokenization: token ids go in and come out; the optional `decode` callable
is used only to detect stop strings.

How a step runs. At every step boundary, waiting requests that fit (`max_batch_size`
rows, and the runner's KV budget `max_tokens_per_batch`) are prefilled in one forward
(identical prompts once) and join the running rows (continuous batching); running rows
advance by one decode forward. Every row then samples with its own params from float32
logits, and finished rows leave the batch at once, their callers answered at that
boundary.

Concurrency contract:
- `generate` (on the event loop) validates, appends to the waiting queue, sets the
  wake-up event and awaits its future.
- The batcher task `_run` (one per engine; the first `generate` or `start()` starts
  it) consumes the waiting queue. It waits for the wake-up event when nothing is queued
  or running, `batch_wait_ms` before the first step of an idle batch (so concurrent
  callers share it), and for `resume()` while paused. Each step holds the model lock
  and runs on the event loop's own thread, and the task yields to the loop after every
  step, so other tasks (an HTTP server, workflows) run between steps, at most one step
  late. Not in a worker thread: on CPU, torch ops from a second thread run with a
  second OpenMP team, and a decode step measured 1.7-1.9x slower there
  (`bench/engine_choices.py`).
- `update_weights`, `set_kv_budget` and `pause` take the same lock, so they never
  overlap a forward: weights and the KV budget change and decoding halts exactly at a
  step boundary. `memory_bytes` only reads sizes (a scheduler sharing the device with
  a trainer asks it, then lowers or raises the budget).
- One request's fault fails that request only. `generate` refuses what the engine
  cannot serve (EngineRequestError) before it joins the batch; a row whose logits come
  out non-finite fails alone; and when a step raises, each of its rows is run again
  alone (prefill and sample) to find the ones that fail by themselves: those fail, the
  others go back to the front of the queue and resume from their tokens so far. A step
  that fails again with no row to blame is the engine's fault: every running and
  waiting request fails with EngineError chained to the cause, and the task goes on
  serving new requests. `stop()` waits for the step in flight, cancels the task, and
  fails every request left with EngineUnavailable (as does the task ending any other
  way).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from looprl.config import EngineConfig
from looprl.diagnostics.oom import oom_phase
from looprl.engines.base import EngineError, EngineRequestError, EngineUnavailable
from looprl.engines.local.fused import KERNELS, unsupported_reason
from looprl.engines.local.runners import FusedRunner, HFRunner
from looprl.engines.local.sampling import sample
from looprl.models import DTYPES, eos_token_ids
from looprl.precision import EnginePrecision, PrecisionError
from looprl.runtime import tune_malloc
from looprl.types import FinishReason, Generation, LoraAdapter, SamplingParams

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    """One generate call, from the waiting queue until its future is resolved."""

    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future[Generation]
    generator: torch.Generator | None  # own RNG when sampling.seed is set
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    @property
    def reserved_tokens(self) -> int:
        return len(self.prompt_ids) + self.sampling.max_new_tokens

    def generation(self) -> Generation:
        assert self.finish_reason is not None, "only a finished request has a Generation"
        return Generation(
            prompt_ids=self.prompt_ids,
            output_ids=self.output_ids,
            logprobs=self.logprobs,
            versions=self.versions,
            finish_reason=self.finish_reason,
            top_logprobs=self.top_logprobs if self.sampling.top_logprobs else None,
        )


class LocalEngine:
    """Serves `generate` from a private copy of `model`, on the device `model` is on.

    `eos_token_ids` end every generation; `decode` (token ids -> text) is needed only
    for requests with stop strings. `version` is the policy version of `model`'s
    weights. `dtype`, `weight_layout`, `kernels` and `graphs` are what start-up decided
    (never auto; graphs "cuda" replays decode steps from CUDA graphs, "eager" runs the
    same static step without them, "off" the plain decode: graphs.py); batching limits
    and `impl` are described in EngineConfig. An engine serves
    the one event loop it is first used on.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: list[int],
        decode: Callable[[list[int]], str] | None = None,
        dtype: str = "float32",
        weight_layout: str = "plain",
        max_batch_size: int = 64,
        max_tokens_per_batch: int = 65536,
        batch_wait_ms: float = 5.0,
        prefix_cache_tokens: int = 8192,
        version: int = 0,
        impl: str = "auto",
        kernels: str = "cpu",
        graphs: str = "off",
    ) -> None:
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"engine dtype={dtype!r} must be 'float32' or 'bfloat16' (engine.dtype=auto "
                "is decided at start-up, looprl/startup.py, which passes the result here)"
            )
        if weight_layout not in ("packed", "plain"):
            raise ValueError(
                f"engine weight_layout={weight_layout!r} must be 'packed' or 'plain' "
                "(engine.weight_layout=auto is decided at start-up, looprl/startup.py)"
            )
        if kernels not in KERNELS:
            raise ValueError(
                f"engine kernels={kernels!r} must be one of {', '.join(KERNELS)} "
                "(engine.kernels=auto is decided at start-up, looprl/startup.py)"
            )
        if max_batch_size < 1 or max_tokens_per_batch < 1:
            raise ValueError(
                f"max_batch_size={max_batch_size} and max_tokens_per_batch="
                f"{max_tokens_per_batch} must both be >= 1"
            )
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens={prefix_cache_tokens} must be >= 0")
        if impl not in ("auto", "fused", "hf"):
            raise ValueError(f"engine impl={impl!r} must be 'auto', 'fused' or 'hf'")
        tune_malloc()
        reason = unsupported_reason(model.config)
        if impl == "fused" and reason:
            raise ValueError(f"engine impl='fused' cannot run this model: {reason}")
        fused = impl != "hf" and not reason
        if weight_layout == "packed" and not fused:
            raise PrecisionError(
                "engine.weight_layout=packed applies to the fused forward, and this engine "
                f"runs the Hugging Face one ({reason or 'engine.impl=hf'}); set "
                "engine.weight_layout=auto"
            )
        self.dtype, self.weight_layout, self.kernels = dtype, weight_layout, kernels
        # A copy, so the trainer can keep updating its own model while this one serves.
        self._model = copy.deepcopy(model).to(DTYPES[dtype]).eval()
        if fused:
            self._runner: FusedRunner | HFRunner = FusedRunner(
                self._model,
                max_tokens_per_batch,
                prefix_cache_tokens,
                packed=weight_layout == "packed",
                kernels=kernels,
                graphs=graphs,
            )
        else:
            if impl == "auto" or graphs != "off":
                unused = "; decode steps without CUDA graphs" if graphs != "off" else ""
                log.info("Local engine: Hugging Face forward (%s)%s", reason, unused)
            self._runner = HFRunner(self._model, max_tokens_per_batch)
        self._eos_token_ids = frozenset(eos_token_ids)
        self._decode = decode
        self._max_batch_size = max_batch_size
        self._max_tokens_per_batch = max_tokens_per_batch
        self._batch_wait_s = batch_wait_ms / 1000
        self._version = version
        self._device = self._model.device
        self._vocab_size = self._model.get_input_embeddings().num_embeddings
        self._max_positions = self._model.config.max_position_embeddings
        # Seeded from torch's global RNG, so torch.manual_seed makes unseeded runs repeatable.
        self._generator = torch.Generator().manual_seed(int(torch.randint(2**62, ())))

        self._waiting: deque[_Request] = deque()
        self._wakeup = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._model_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

        # The running batch, touched only by the batcher task.
        self._rows: list[_Request] = []
        self._last_tokens = torch.zeros(0, dtype=torch.long)  # (B,) next decode input
        self._cache_is_stale = False  # set by update_weights: recompute before decoding
        self._unexplained_failures = 0  # failed steps in a row with no request to blame

    @classmethod
    def for_model(
        cls, model: PreTrainedModel, tokenizer, cfg: EngineConfig, precision: EnginePrecision
    ) -> LocalEngine:
        """An engine on its own copy of `model` in the `precision` start-up decided, with
        `cfg`'s batching limits, stopping at `tokenizer`'s EOS ids and detecting stop
        strings with its decode."""
        return cls(
            model,
            eos_token_ids=eos_token_ids(tokenizer, model),
            decode=tokenizer.decode,
            dtype=precision.dtype,
            weight_layout=precision.weight_layout,
            kernels=precision.kernels,
            graphs="cuda" if precision.cuda_graphs else "off",
            max_batch_size=cfg.max_batch_size,
            max_tokens_per_batch=cfg.max_tokens_per_batch,
            batch_wait_ms=cfg.batch_wait_ms,
            prefix_cache_tokens=cfg.prefix_cache_tokens,
            impl=cfg.impl,
        )

    @property
    def version(self) -> int:
        return self._version

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, session: str | None = None
    ) -> Generation:
        """Sample a continuation; waits while the batch is full or the engine paused.
        `session` is not used: one engine serves every session."""
        self._validate(prompt_ids, sampling)
        await self.start()
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator().manual_seed(sampling.seed)
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_Request(list(prompt_ids), sampling, future, generator))
        self._wakeup.set()
        return await future

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy `state_dict` into the engine's model between two steps; set `version`.
        The fused forward's plain weights are written in place: an update allocates no
        weight memory (packed weights are packed anew)."""
        async with self._model_lock:
            try:
                self._load(state_dict)
            except RuntimeError as e:
                raise EngineError(
                    f"update_weights(version={version}): the state dict does not match the "
                    f"engine's model ({type(self._model).__name__}): {e}"
                ) from e
            self._version = version
            self._cache_is_stale = True

    def _load(self, state_dict: dict[str, torch.Tensor]) -> None:
        self._model.load_state_dict(state_dict)
        self._runner.reload(self._model)

    async def update_adapter(self, adapter: LoraAdapter, version: int) -> None:
        """Serve the base weights with `adapter` applied, in place of the previous adapter,
        between two steps; set `version`. The engine's copy of the base stays as it is:
        the fused forward rebuilds its fused weights from it with the adapter merged in,
        the Hugging Face forward adds a low-rank term per adapted module."""
        async with self._model_lock:
            try:
                self._runner.adapt(adapter)
            except (ValueError, RuntimeError) as e:
                raise EngineError(
                    f"update_adapter(version={version}): the adapter does not fit the "
                    f"engine's model ({type(self._model).__name__}): {e}"
                ) from e
            self._version = version
            self._cache_is_stale = True

    async def set_kv_budget(self, tokens: int) -> None:
        """Set the KV budget (`max_tokens_per_batch`) between two steps, e.g. to make room
        for a trainer on the same device. Running rows keep running; requests are admitted
        and validated under the new budget, and a waiting one it can never fit fails. The
        cache memory the new budget no longer allows is released as soon as no row runs."""
        if tokens < 1:
            raise ValueError(f"set_kv_budget(tokens={tokens}): the budget must be >= 1")
        async with self._model_lock:
            self._max_tokens_per_batch = tokens
            self._runner.set_budget(tokens)

    def memory_bytes(self) -> dict[str, int]:
        """What the engine holds on its device: {"weights": its model's parameters and the
        fused forward's weights, shared storage counted once, "kv_cache": the KV cache}."""
        return self._runner.memory_bytes()

    async def pause(self) -> None:
        """Halt decoding; returns once the step in flight (if any) has finished."""
        self._resumed.clear()
        async with self._model_lock:
            pass

    async def resume(self) -> None:
        self._resumed.set()

    async def start(self) -> None:
        """Start the batcher task on the running loop (generate does it on first use)."""
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._run(), name="looprl-local-engine")

    async def stop(self) -> None:
        """End the batcher task after the step in flight; unfinished requests fail."""
        task, self._task = self._task, None
        if task is None:
            return
        async with self._model_lock:
            task.cancel()
            await asyncio.wait([task])

    def _validate(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        if not prompt_ids:
            raise EngineRequestError(
                "prompt_ids is empty; the engine needs at least one prompt token"
            )
        bad = [i for i in prompt_ids if not 0 <= i < self._vocab_size]
        if bad:
            raise EngineRequestError(
                f"prompt_ids holds {bad[0]}, outside the model's vocabulary [0, "
                f"{self._vocab_size}); tokenize with the model's own tokenizer"
            )
        total = len(prompt_ids) + sampling.max_new_tokens
        if total > self._max_positions:
            raise EngineRequestError(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens="
                f"{sampling.max_new_tokens} = {total} exceeds the model's "
                f"max_position_embeddings={self._max_positions}; shorten the prompt or "
                "lower max_new_tokens"
            )
        if total > self._max_tokens_per_batch:
            raise EngineRequestError(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens="
                f"{sampling.max_new_tokens} = {total} exceeds the engine's KV budget "
                f"max_tokens_per_batch={self._max_tokens_per_batch}; raise "
                "engine.max_tokens_per_batch or lower max_new_tokens"
            )
        if sampling.stop and self._decode is None:
            raise EngineRequestError(
                f"stop={sampling.stop!r} needs text, but this engine has no decode "
                "function; build it with decode=tokenizer.decode (from_config does)"
            )

    async def _run(self) -> None:
        try:
            while True:
                if not self._rows:
                    while not self._waiting:
                        self._wakeup.clear()
                        await self._wakeup.wait()
                    await asyncio.sleep(self._batch_wait_s)
                await self._resumed.wait()
                try:
                    async with self._model_lock:
                        new = self._admit()
                        try:
                            with oom_phase("generation", self._memory_settings):
                                finished = self._step(new, self._version)
                            self._unexplained_failures = 0
                        except Exception as e:
                            finished = []
                            self._isolate(e)
                    for request in finished:
                        if not request.future.done():
                            request.future.set_result(request.generation())
                except Exception as e:
                    log.exception("The local engine failed a step; failing every request")
                    self._fail_all(e)
                await asyncio.sleep(0)  # let callers, HTTP handlers and workflows run
        finally:
            self._fail_all(None)

    def _memory_settings(self) -> dict[str, object]:
        return {
            "engine.max_tokens_per_batch": self._max_tokens_per_batch,
            "engine.max_batch_size": self._max_batch_size,
            "running requests": len(self._rows),
        }

    def _admit(self) -> list[_Request]:
        """Move waiting requests that fit the batch limits into the next step, in order."""
        new: list[_Request] = []
        reserved = [r.reserved_tokens for r in self._rows]
        while self._waiting and len(self._rows) + len(new) < self._max_batch_size:
            request = self._waiting[0]
            if request.future.done():  # the caller gave up (cancelled) while waiting
                self._waiting.popleft()
                continue
            if not self._runner.fits([*reserved, request.reserved_tokens]):
                if reserved:
                    break  # first come, first served: later requests do not overtake it
                self._waiting.popleft()  # alone it never fits: set_kv_budget lowered it
                request.future.set_exception(
                    EngineRequestError(
                        f"this request needs {request.reserved_tokens} tokens of KV cache "
                        "(prompt + max_new_tokens), more than the engine's KV budget, "
                        f"lowered to {self._max_tokens_per_batch} while it waited; lower "
                        "max_new_tokens"
                    )
                )
                continue
            reserved.append(request.reserved_tokens)
            new.append(self._waiting.popleft())
        return new

    def _fail_all(self, cause: Exception | None) -> None:
        """Fail every running and waiting request (cause None: the engine stopped, and
        cannot serve them: EngineUnavailable)."""
        requests = [*self._rows, *self._waiting]
        self._waiting.clear()
        self._reset_batch()
        for request in requests:
            if request.future.done():
                continue
            if cause is None:
                error = EngineUnavailable("the local engine stopped before this request finished")
            else:
                error = EngineError(
                    f"the local engine failed while serving this request: "
                    f"{type(cause).__name__}: {cause}"
                )
                error.__cause__ = cause
            request.future.set_exception(error)

    @torch.inference_mode()
    def _isolate(self, cause: Exception) -> None:
        """After a step raised `cause`: run each of its rows alone to find those that fail
        by themselves and fail only them; the others wait at the front of the queue and
        resume from their tokens so far. Raises `cause` when no row is to blame twice in
        a row (the engine itself is failing)."""
        rows = [r for r in self._rows if not r.future.done()]
        self._reset_batch()
        self._cache_is_stale = False  # every row is prefilled again from its tokens
        blamed, survivors = 0, []
        for request in rows:
            # The trial draws are put back: a seeded request samples as if nothing failed.
            generators = [g for g in (self._generator, request.generator) if g is not None]
            states = [g.get_state() for g in generators]
            try:
                self._runner.reset()
                logits = self._runner.prefill(
                    [request.prompt_ids + request.output_ids], [request.reserved_tokens]
                )
                sample(logits, [request.sampling], self._generator, [request.generator])
            except Exception as e:
                blamed += 1
                error = EngineError(
                    "this request fails the engine's forward or sampling even alone: "
                    f"{type(e).__name__}: {e}"
                )
                error.__cause__ = e
                request.future.set_exception(error)
            else:
                survivors.append(request)
            finally:
                for generator, state in zip(generators, states, strict=True):
                    generator.set_state(state)
        self._runner.reset()
        self._waiting.extendleft(reversed(survivors))
        if blamed:
            self._unexplained_failures = 0
            log.warning(
                "The local engine's step failed (%s: %s); %d of its %d requests fail alone "
                "and were failed, the other %d go on",
                type(cause).__name__,
                cause,
                blamed,
                len(rows),
                len(survivors),
            )
            return
        self._unexplained_failures += 1
        if self._unexplained_failures > 1:
            raise cause
        log.warning(
            "The local engine's step failed (%s: %s) but each of its %d requests runs alone; "
            "trying them again",
            type(cause).__name__,
            cause,
            len(rows),
        )

    def _reset_batch(self) -> None:
        self._rows = []
        self._runner.reset()
        self._last_tokens = self._last_tokens[:0]

    @torch.inference_mode()
    def _step(self, new: list[_Request], version: int) -> list[_Request]:
        """One decode forward for running rows, one prefill for `new`; sample; prune.

        Runs while the batcher task holds the model lock. Returns the
        requests that finished at this step. After update_weights, every running row is
        prefilled again (prompt + tokens so far) with the new weights instead of decoded
        on a cache the old weights computed, so each token tagged `version` is sampled
        from exactly that version's policy (as in AReaL's interruptible generation).
        """
        running = self._rows
        self._rows = running + new  # first, so a failing step's _isolate sees these rows too
        if not self._rows:
            return []
        parts = []
        if running and self._cache_is_stale:
            parts.append(self._runner.refill([r.prompt_ids + r.output_ids for r in running]))
        elif running:
            parts.append(self._runner.decode(self._last_tokens))
        self._cache_is_stale = False
        if new:
            sequences = [r.prompt_ids + r.output_ids for r in new]
            parts.append(self._runner.prefill(sequences, [r.reserved_tokens for r in new]))
        logits = torch.cat(parts)
        rows = self._rows
        tokens, logprobs, top = sample(
            logits, [r.sampling for r in rows], self._generator, [r.generator for r in rows]
        )
        finite = torch.isfinite(logprobs).tolist()
        finished, keep = [], []
        for i, (request, token, logprob) in enumerate(
            zip(self._rows, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            if not finite[i]:  # this row's logits hold NaN or inf: it alone fails
                if not request.future.done():
                    request.future.set_exception(
                        EngineError(
                            f"the model's logits for this request were not finite at output "
                            f"token {len(request.output_ids)} (logprob {logprob}); the other "
                            "requests in the batch go on"
                        )
                    )
                continue
            request.output_ids.append(token)
            request.logprobs.append(logprob)
            request.versions.append(version)
            if request.sampling.top_logprobs:
                request.top_logprobs.append(top[i][: request.sampling.top_logprobs])
            request.finish_reason = self._finish_reason(request)
            # A cancelled caller's row is dropped instead of decoded to the end.
            if request.finish_reason or request.future.done():
                finished.append(request)
            else:
                keep.append(i)
        self._last_tokens = tokens
        if len(keep) < len(self._rows):
            self._rows = [self._rows[i] for i in keep]
            self._last_tokens = tokens[torch.tensor(keep, dtype=torch.long, device=tokens.device)]
            self._runner.keep(keep)
        return finished

    def _finish_reason(self, request: _Request) -> FinishReason | None:
        token, sampling = request.output_ids[-1], request.sampling
        if token in self._eos_token_ids or token in sampling.stop_token_ids:
            return "stop"
        if sampling.stop and self._decode is not None:
            # Decode only the tail that can hold a stop string ending at this token: a
            # string of n characters is at most 4n UTF-8 bytes, hence at most 4n tokens,
            # plus one token that may start mid-character.
            window = 4 * max(len(s) for s in sampling.stop) + 1
            text = self._decode(request.output_ids[-window:])
            if any(s in text for s in sampling.stop):
                return "stop"
        if len(request.output_ids) >= sampling.max_new_tokens:
            return "length"
        return None
