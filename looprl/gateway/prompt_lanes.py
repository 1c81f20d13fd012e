"""Where prompts are built: worker threads, in two lanes, never the event loop.

Owns: running prompt work (a chat template's rendering, tokenizing, decoding a
session's earlier calls: prompts.py) off the event loop the engine, the HTTP server and
every other call share, with bounded concurrency. Does not own what the work is
(prompts.py) nor when a request stops waiting for it (app.py cancels a job whose client
left or whose session closed).

Why threads help: the tokenizer (Hugging Face `tokenizers`, in Rust) releases the GIL
while it encodes; a 3.9 MB prompt took 2.7 s, of which the thread held the GIL for
under 0.1 s at a time (turning ids into a Python list). On the event loop the same
call stalled every other request for its whole length. Template rendering (jinja, in
Python) holds the GIL but is milliseconds even for megabytes.

Why two lanes: requests whose body is over LARGE_BODY_BYTES wait in their own queue
for LARGE_WORKERS thread(s), so a burst of huge prompts (20 count_tokens of 4 MB)
queues behind itself and small requests, served by SMALL_WORKERS threads, never wait
behind it. The large lane's threads run at a lower CPU priority: on 2 cores, a
tokenizing thread at the engine's priority slowed a CPU engine's decode steps (its
OpenMP team waited for a core) and an innocent call took up to 0.98 s instead of 0.1 s;
niced, up to 0.44 s. Each lane is a FIFO; a job not yet started is dropped when its caller
cancels (asyncio cancels the executor's future), one already running finishes in its
thread and its result is discarded.

Concurrency contract: `run` is called on the event loop and awaits the job's result
(or its exception); the job runs in a lane's thread and must not touch state the loop
mutates without a lock (prompts.py holds the session's `prompt_lock` where it does).
One set of lanes serves every gateway of a process (`PromptLanes.shared`); its threads
are made on first use and end with the process (joined at exit, idle).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

LARGE_BODY_BYTES = 256 * 1024  # a body over this is built in the large lane
SMALL_WORKERS = 2  # threads for ordinary requests: their jobs take milliseconds
LARGE_WORKERS = 1  # threads for large ones: each keeps a core busy for seconds
LARGE_NICE = 10  # their CPU priority, below the engine's and small requests' (Linux)


class PromptLanes:
    """Two thread pools: one for requests up to LARGE_BODY_BYTES, one for larger ones."""

    _shared: PromptLanes | None = None
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> PromptLanes:
        """The process's lanes, made on first use. Every gateway of a process uses them:
        they share its cores anyway, and threads made per gateway would outlive it (an
        idle pool's threads end only with the process; a test run that made a gateway
        per test left hundreds, past what a hang report's stack dump shows)."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def __init__(self) -> None:
        self._small = ThreadPoolExecutor(SMALL_WORKERS, thread_name_prefix="looprl-prompt")
        self._large = ThreadPoolExecutor(
            LARGE_WORKERS, thread_name_prefix="looprl-prompt-large", initializer=_yield_cpu
        )

    async def run(self, body_bytes: int, job: Callable[[], T]) -> T:
        """`job()` in the lane a request body of `body_bytes` bytes belongs to."""
        lane = self._large if body_bytes > LARGE_BODY_BYTES else self._small
        return await asyncio.get_running_loop().run_in_executor(lane, job)


def _yield_cpu() -> None:
    """Lower this thread's CPU priority (nice 10), so that where cores are few, decoding
    and small requests run before a large prompt's tokenizing. Linux only: elsewhere a
    thread id is no process id to `setpriority`."""
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LARGE_NICE)
