"""Episode frames: what a rendering env showed at reset and after each step, saved as one
animated GIF per episode in the run's frames folder, `<session_id>.gif`, where
session_id is the one of the episode's rows in the trajectory files (`env.frames_every`).
Where the file goes is not decided here: the caller names it (`frame_file(RunPaths.frames,
session_id)`, looprl/runs/paths.py).

Owns, in an env worker: `FrameRecorder` (one episode's frames, each downscaled to at most
FRAME_MAX_SIDE pixels a side and kept as PNG bytes, at most `max_frames` of them),
`EpisodeFrames` (the worker's recorders and its first render failure, after which it
renders no more) and `write_gif` (atomic, through looprl/runs/atomic.py). An env renders
by Gymnasium's convention: built with render_mode="rgb_array", its `render()` returns an
(H, W, 3) uint8 array.

The cap: a recorder keeps frames 0, stride, 2 x stride, ... and the latest one; when they
would be more than `max_frames`, the stride doubles (every other one is dropped), so a
long episode is shown whole at a coarser step, its last frame always last. Dropped
frames are counted. Each frame shows for FRAME_MS in the GIF (a GIF shows a frame identical to the
one before as that one, longer: its durations add up to FRAME_MS per frame kept).
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from looprl.diagnostics import rendering
from looprl.runs.atomic import atomic_write

FRAME_MAX_SIDE = 240  # pixels: a 600x400 CartPole frame is saved as 240x160
FRAME_MS = 100  # how long each frame shows: one turn per tenth of a second


class FrameRecorder:
    """One episode's frames, `max_frames` at most (see the module docstring)."""

    def __init__(self, max_frames: int) -> None:
        if max_frames < 2:
            raise ValueError(f"max_frames={max_frames}: keep at least the first and last frame")
        self.max_frames = max_frames
        self.kept: list[tuple[int, bytes]] = []  # (index, PNG) of frames 0, stride, ...
        self.stride = 1
        self.count = 0  # frames added
        self.latest = b""  # the last frame added, which ends the episode's file

    def add(self, frame: Any) -> None:
        """Add `frame`, an (H, W, 3) uint8 array; the stride doubles while too many are kept."""
        self.latest = _small_png(frame)
        index, self.count = self.count, self.count + 1
        if index % self.stride == 0:
            self.kept.append((index, self.latest))
        while len(self.frames()) > self.max_frames:
            self.stride *= 2
            self.kept = [(i, png) for i, png in self.kept if i % self.stride == 0]

    def frames(self) -> list[bytes]:
        """The frames kept (PNG), the latest last."""
        if not self.count:
            return []
        on_stride = self.kept[-1][0] == self.count - 1
        return [png for _, png in self.kept] + ([] if on_stride else [self.latest])


class EpisodeFrames:
    """An env worker's frame recorders, by episode id. The first render that fails
    (pygame missing, MUJOCO_GL without its library) stops this worker's rendering: every
    recorded episode after it is reported as failed, with `looprl doctor`'s diagnosis."""

    def __init__(self, max_frames: int) -> None:
        self.max_frames = max_frames
        self.recorders: dict[str, FrameRecorder] = {}
        self.failure: dict[str, str] | None = None  # {"failed": why, "diagnosis": ...}

    def start(self, episode: str, env: Any, record: bool) -> None:
        """At reset: record this episode (its first frame now) or not."""
        self.recorders.pop(episode, None)
        if record:
            self.recorders[episode] = FrameRecorder(self.max_frames)
            self.capture(episode, env)

    def capture(self, episode: str, env: Any) -> None:
        """After a step: the env's frame, if this episode is recorded and rendering works."""
        recorder = self.recorders.get(episode)
        if recorder is None or self.failure is not None:
            return
        with _quiet_unraisable():
            try:
                recorder.add(env.render())
            except Exception as e:  # the env's or its renderer's: no frames from here on
                diagnosis = rendering.diagnose() or "looprl doctor finds no rendering fault here"
                self.failure = {"failed": f"{type(e).__name__}: {e}", "diagnosis": diagnosis}

    def save(self, episode: str, path: str) -> dict[str, Any]:
        """Write the episode's frames to `path`: {"frames": kept, "dropped": n}, or
        {"failed": why, "diagnosis": ...} when rendering or the write failed."""
        recorder = self.recorders.pop(episode, None)
        if self.failure is not None:
            return self.failure
        if recorder is None:
            return {"failed": "the episode was not recorded (reset without record)"}
        frames = recorder.frames()
        try:
            write_gif(Path(path), frames)
        except OSError as e:
            return {"failed": f"could not write {path}: {e}"}
        return {"frames": len(frames), "dropped": recorder.count - len(frames)}

    def drop(self, episode: str) -> None:
        self.recorders.pop(episode, None)


@contextlib.contextmanager
def _quiet_unraisable() -> Iterator[None]:
    """A renderer left half-built by a failed render may fail again when it is deleted
    (gymnasium's MuJoCo OffScreenViewer.__del__ raises AttributeError, which Python
    prints as a traceback): an echo of the failure reported, so it is not printed."""
    hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
    try:
        yield
    finally:
        sys.unraisablehook = hook


def write_gif(path: Path, frames: list[bytes]) -> None:
    """`frames` (PNG bytes) as an animated GIF at `path`, written atomically
    (`atomic_write`: a reader sees the whole file or none; not fsynced)."""
    images = [Image.open(io.BytesIO(frame)).convert("RGB") for frame in frames]

    def save(tmp: Path) -> None:
        images[0].save(
            tmp, format="GIF", save_all=True, append_images=images[1:], duration=FRAME_MS, loop=0
        )

    atomic_write(path, save)


def _small_png(frame: Any) -> bytes:
    array = np.asarray(frame)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        shown = "None" if frame is None else f"{array.dtype} {array.shape}"
        raise TypeError(
            f"render() must return an (H, W, 3) uint8 RGB array, got {shown} (an env that "
            "renders is built with render_mode='rgb_array')"
        )
    image = Image.fromarray(array)
    image.thumbnail((FRAME_MAX_SIDE, FRAME_MAX_SIDE))
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=1)
    return out.getvalue()
