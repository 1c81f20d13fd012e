"""The fused decode step replayed from CUDA graphs (engine.cuda_graphs).

Why. On a GPU a decode step of a small model is the host's: 30 layers of ~20 kernels
each, every one launched from Python. Measured on one H200 (bench/gpu_profile.py, 256
rows of SmolLM2-135M, bf16, portable kernels): 26 ms a step eager, 5 ms replayed from
one CUDA graph (so its kernels take 5 ms at most). A graph records the kernels once and
relaunches them all in one call.

How. A graph replays fixed shapes and addresses, so the step runs `FusedDecoder.
decode_static`: row r is slot r for every slot below `top` (free slots are fed token 0
at position 0, their logits dropped), attending to `width` columns. `top` is rounded up
to a power of two and `width` to a multiple of WIDTH_STEP, so a run needs a few graphs
(one per (top, width) met), each captured the first time its shape comes up. Inputs and
logits live in buffers shared by every graph: a step writes the tokens and positions of
its rows into them, replays, and gathers its rows' logits. Captured graphs hold the
addresses of the weights and the KV cache, so each step checks the cache's storage and
shape, and `weights_loaded()` (after every load) the addresses of the weights: a change
drops every graph. update_weights writes the weights in place, so the graphs stay; an
adapter merged into a weight the model shares moves it, and they are captured anew.

A capture that fails (a torch or driver error) is logged once and the engine goes on
with the same static step run eagerly.

`capture=False` runs the same static step eagerly, without a graph: what the graphs
replay, on any device (the CPU tests of this path, `engine.cuda_graphs` off a GPU is
refused at start-up).
"""

from __future__ import annotations

import logging

import torch

from looprl.engines.local.fused import FusedDecoder, attention_width
from looprl.engines.local.kv_cache import SlotCache

log = logging.getLogger(__name__)

GRAPHS = ("off", "cuda", "eager")  # how a runner decodes (runners.FusedRunner)
MAX_GRAPHS = 64  # past this many shapes, every graph is dropped and captured anew


def rows_bucket(rows: int) -> int:
    """The next power of two at or above `rows`."""
    return 1 << max(rows - 1, 0).bit_length()


class DecodeGraphs:
    def __init__(self, decoder: FusedDecoder, cache: SlotCache, *, capture: bool) -> None:
        if capture and decoder.device.type != "cuda":
            raise ValueError(
                f"CUDA graphs need a CUDA device; the engine's model is on {decoder.device}"
            )
        self._decoder, self._cache, self._capture = decoder, cache, capture
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._layout: tuple | None = None  # the cache's storage and shape the graphs read
        self._pool = None
        self._ids = self._positions = self._logits = None
        self.captures = 0  # graphs captured so far (read by tests)
        self.failed: str | None = None  # why capturing failed, after which none is tried

        self._weights = self._weight_addresses()

    def clear(self) -> None:
        """Drop every captured graph."""
        self._graphs.clear()

    def weights_loaded(self) -> None:
        """The decoder loaded weights: graphs stay valid only where every weight tensor is
        where it was when they were captured."""
        addresses = self._weight_addresses()
        if addresses != self._weights:
            self.clear()
            self._weights = addresses

    def _weight_addresses(self) -> tuple[int, ...]:
        return tuple(w.data_ptr() for w in self._decoder.weights())

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: list[int], slots: list[int]) -> torch.Tensor:
        """FusedDecoder.decode for rows in `slots` at `positions` fed `tokens` (B,):
        (B, V) float32 logits, row r for slots[r]."""
        cache, device = self._cache, self._decoder.device
        have_slots, have_columns = cache.shape
        top = min(rows_bucket(max(slots) + 1), have_slots)
        width = attention_width(max(positions) + 1, have_columns)
        layout = (cache.v.untyped_storage().data_ptr(), have_slots, have_columns)
        if layout != self._layout:
            self.clear()
            self._layout = layout
        if self._ids is None or self._ids.shape[0] < have_slots:
            self.clear()  # the graphs read the buffers' addresses
            vocab = self._decoder.lm_head.shape[0]
            self._ids = torch.zeros(have_slots, dtype=torch.long, device=device)
            self._positions = torch.zeros(have_slots, dtype=torch.long, device=device)
            self._logits = torch.zeros(have_slots, vocab, dtype=torch.float32, device=device)
        rows, at = torch.tensor((slots, positions), device=device)  # one upload a step
        self._ids[:top].zero_()
        self._positions[:top].zero_()
        self._ids[rows] = tokens.to(device)
        self._positions[rows] = at
        graph = self._graphs.get((top, width)) if self._capture else None
        if graph is None and self._capture:
            try:
                graph = self._record(top, width)
            except RuntimeError as e:  # the same step runs eagerly: slower, not wrong
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                log.warning(
                    "Local engine: capturing a CUDA graph of the decode step (%d rows x %d "
                    "columns) failed (%s); decode steps run without CUDA graphs from now "
                    "on (engine.cuda_graphs=off skips trying)", top, width, self.failed,
                )  # fmt: skip
                self._capture = False
                self.clear()
        if graph is None:
            self._step(top, width)
        else:
            graph.replay()
        return self._logits[rows]

    def _step(self, top: int, width: int) -> None:
        logits = self._decoder.decode_static(
            self._cache, self._ids[:top], self._positions[:top], width
        )
        self._logits[:top].copy_(logits)

    def _record(self, top: int, width: int) -> torch.cuda.CUDAGraph:
        if len(self._graphs) >= MAX_GRAPHS:
            self.clear()
        if self._pool is None or not self._graphs:
            # The graphs share one memory pool, which lives only while a graph captured
            # into it does: capturing into a pool whose graphs are all gone fails an
            # assertion in torch's allocator (seen on an H200, torch 2.11, once clear() had
            # dropped them all), so a fresh pool then. A dropped pool's memory goes back
            # to the allocator at its next empty_cache (one runs before it reports OOM).
            self._pool = torch.cuda.graph_pool_handle()
        # One eager run on a side stream first: cuBLAS and cuDNN make their plans and
        # workspaces outside the capture. It writes the same K/V the replay writes.
        device = self._decoder.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._step(top, width)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a trainer thread's CUDA work during the capture is not an error
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._step(top, width)
        self._graphs[(top, width)] = graph
        self.captures += 1
        return graph
