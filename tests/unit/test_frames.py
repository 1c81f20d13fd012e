"""Episode frames (looprl/envs/frames.py): downscaled, capped, written as a GIF."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from looprl.envs.frames import FRAME_MS, EpisodeFrames, FrameRecorder
from looprl.runs.paths import RunPaths, frame_file


def _frame(value: int, height: int = 400, width: int = 600) -> np.ndarray:
    return np.full((height, width, 3), value, np.uint8)


def _values(recorder: FrameRecorder) -> list[int]:
    """The frames kept, each by its (uniform) pixel value."""
    return [int(np.asarray(Image.open(io.BytesIO(f)))[0, 0, 0]) for f in recorder.frames()]


@pytest.mark.parametrize(
    ("added", "kept"),
    [
        (3, [0, 1, 2]),
        (4, [0, 1, 2, 3]),
        (5, [0, 2, 4]),  # five would be too many: every other one
        (6, [0, 2, 4, 5]),  # the latest always ends the file
        (7, [0, 2, 4, 6]),
        (8, [0, 4, 7]),  # 0, 2, 4, 6 and 7 too many: every fourth
        (9, [0, 4, 8]),
        (10, [0, 4, 8, 9]),
    ],
)
def test_the_cap_keeps_the_whole_episode_at_a_coarser_step(added, kept):
    recorder = FrameRecorder(max_frames=4)
    for i in range(added):
        recorder.add(_frame(i * 10))
    assert _values(recorder) == [v * 10 for v in kept]
    assert recorder.count == added and len(recorder.frames()) <= 4


def test_frames_are_downscaled_and_must_be_rgb_arrays():
    recorder = FrameRecorder(max_frames=10)
    recorder.add(_frame(7))
    recorder.add(_frame(7, 480, 480))
    sizes = [Image.open(io.BytesIO(f)).size for f in recorder.frames()]
    assert sizes == [(240, 160), (240, 240)]
    with pytest.raises(TypeError, match=r"render\(\) must return an \(H, W, 3\) uint8.*None"):
        recorder.add(None)
    with pytest.raises(TypeError, match="float64"):
        recorder.add(np.zeros((4, 4, 3)))


class Broken:
    def render(self):
        raise RuntimeError("no display")


class Painter:
    def __init__(self):
        self.value = 0

    def render(self):
        self.value += 40
        return _frame(self.value, 40, 60)


def test_a_worker_saves_a_gif_and_stops_rendering_after_a_failure(tmp_path):
    frames = EpisodeFrames(max_frames=10)
    env = Painter()
    frames.start("e0", env, record=True)
    frames.capture("e0", env)
    frames.capture("e0", env)
    path = frame_file(RunPaths(tmp_path).frames, "s1")
    assert frames.save("e0", str(path)) == {"frames": 3, "dropped": 0}
    with Image.open(path) as gif:
        assert gif.n_frames == 3 and gif.size == (60, 40)
        gif.seek(2)
        assert gif.info["duration"] == FRAME_MS
        assert np.asarray(gif.convert("RGB"))[0, 0, 0] == 120
    assert [p.name for p in path.parent.iterdir()] == ["s1.gif"]  # no temporary left
    frames.start("e1", Broken(), record=True)
    frames.start("e2", env, record=True)  # after the failure: nothing renders
    failed = frames.save("e1", str(tmp_path / "e1.gif"))
    assert failed["failed"] == "RuntimeError: no display" and failed["diagnosis"]
    assert frames.save("e2", str(tmp_path / "e2.gif")) == failed
    assert env.value == 120
