"""Simulators in the loop: CartPole (classic control) and InvertedPendulum (MuJoCo) played
through the gateway by a tiny model, their state given as text and their frames saved
beside the trajectories (env.frames_every); a render that fails is logged with `looprl
doctor`'s diagnosis and the episodes go on without frames.

The tiny random model never names a move, so these tests play `pole_model_dir`: the same
model with an output head that can only say " left" or " right" (which one depends on the
prompt). Each prompt is checked against the env's own observation, replayed here from
the seed and the moves the model made.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re

import gymnasium
import numpy as np
import pytest
import torch
from PIL import Image

from looprl import startup
from looprl.config import load_config
from looprl.diagnostics.rendering import choose_mujoco_gl, find_renderers
from looprl.envs.frames import FRAME_MS
from looprl.envs.workers import EnvWorkers
from looprl.models import load_model, load_tokenizer
from looprl.runs.paths import RunPaths, frame_file
from looprl.scheduling.single_process import start_single_process
from looprl.tasks import load_task
from looprl.workflows.resolution import configured_workflow

SEEDS = [1_000_000, 1_000_001]
STEPS = 4  # env.kwargs.max_episode_steps: each episode is truncated after 4 pushes
POLE = re.compile(
    r"The cart is ([\d.]+) m (left|right) of the centre of its track \(which ends ([\d.]+) m "
    r"either side\) and moves (left|right) at ([\d.]+) m/s\. The pole leans ([\d.]+) degrees "
    r"(left|right) \(it falls at ([\d.]+) degrees\) and tips (left|right) at ([\d.]+) degrees "
    r"per second\. Reply with one word: left or right\.$"
)


@pytest.fixture(scope="module")
def pole_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model whose output head has two non-zero rows, " left" = v and " right" =
    -v: whichever the hidden state favours has the only positive logit, so every greedy
    reply is a move."""
    model = load_model(tiny_model_dir)
    tokenizer = load_tokenizer(tiny_model_dir)
    (left,) = tokenizer.encode(" left", add_special_tokens=False)
    (right,) = tokenizer.encode(" right", add_special_tokens=False)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        direction = torch.randn(head.shape[1], generator=torch.Generator().manual_seed(0))
        head.zero_()
        head[left], head[right] = direction, -direction
    out = tmp_path_factory.mktemp("pole-llama")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


async def _play(model_dir, run_dir, env_id: str, *overrides: str):
    """SEEDS played once each, greedily; (result, workflow)."""
    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            f"run.fileroot={run_dir}",
            "engine.dtype=float32",
            "sampling.temperature=0",
            "sampling.max_new_tokens=2",
            "rollout.group_size=1",
            f"env.name=gymnasium:{env_id}",
            f"env.kwargs={{max_episode_steps: {STEPS}}}",
            f"env.max_turns={STEPS + 2}",
            "env.frames_every=1",
            *overrides,
        ],
    )
    workflow = configured_workflow(
        cfg, load_task(cfg.task), frames_dir=RunPaths(cfg.run_dir).frames
    )
    try:
        async with start_single_process(startup.start(cfg, train=False), workflow) as parts:
            result = await parts.controller.rollout_batch([{"seed": s} for s in SEEDS])
            return result, workflow, cfg.run_dir
    finally:
        workflow.close()


def _read_pole(text: str) -> tuple[float, float, float, float, float, float]:
    """(x m, track m, x' m/s, lean degrees, fall degrees, tip degrees/s) from a prompt;
    right is positive."""
    match = POLE.search(text)
    assert match, text
    at, side, track, way, speed, lean, lean_side, fall, tip_side, tip = match.groups()

    def signed(value: str, direction: str) -> float:
        return float(value) * (-1 if direction == "left" else 1)

    return (
        signed(at, side),
        float(track),
        signed(speed, way),
        signed(lean, lean_side),
        float(fall),
        signed(tip, tip_side),
    )


def _check_episodes(result, env_id: str, order: tuple[int, int, int, int], limits) -> list:
    """Each episode: STEPS moves, each prompt the env's observation in words (replayed
    from the seed and the model's moves; `order` maps (x, x', angle, angle') into the
    observation vector), reward 1 per step, success (truncated, still up). Returns the
    episodes' observations, for the frames."""
    assert result.stats()["completed"] == 2 and result.stats()["errors"] == {}
    episodes = []
    for outcome, seed in zip(result.outcomes, SEEDS, strict=True):
        calls = outcome.calls
        assert len(calls) == STEPS  # truncated by max_episode_steps, before env.max_turns
        assert [t.reward for t in outcome.trajectories] == [4.0, 3.0, 2.0, 1.0]
        assert outcome.reward == STEPS and outcome.success is True
        env = gymnasium.make(env_id, max_episode_steps=STEPS)
        observation, _ = env.reset(seed=seed)
        observations = [observation]
        for call in calls:
            shown = _read_pole(call["messages"][-1]["content"])
            x, velocity, angle, turn = (float(observation[i]) for i in order)
            assert shown[0] == pytest.approx(x, abs=0.006)
            assert shown[1:5:3] == limits  # track, fall angle
            assert shown[2] == pytest.approx(velocity, abs=0.006)
            assert shown[3] == pytest.approx(np.degrees(angle), abs=0.06)
            assert shown[5] == pytest.approx(np.degrees(turn), abs=0.06)
            move = call["reply"].split()[0]
            assert move in ("left", "right")
            action = ("left", "right").index(move)
            if env_id.startswith("InvertedPendulum"):
                action = np.array([(-0.3, 0.3)[action]], np.float32)
            observation, reward, terminated, truncated, _ = env.step(action)
            observations.append(observation)
            assert reward == 1.0 and not terminated
        assert truncated
        episodes.append((outcome.trajectories[0].session_id, observations))
    return episodes


def _read_gif(path) -> list[Image.Image]:
    """The GIF's frames, each repeated by its duration (a GIF shows a frame identical to
    the one before as that one, longer)."""
    frames = []
    with Image.open(path) as gif:
        for i in range(gif.n_frames):
            gif.seek(i)
            assert gif.info["duration"] % FRAME_MS == 0
            frames += [gif.convert("RGB")] * (gif.info["duration"] // FRAME_MS)
    return frames


async def test_cart_pole_in_words_with_its_frames_beside_the_trajectories(pole_model_dir, tmp_path):
    result, workflow, run_dir = await _play(pole_model_dir, tmp_path, "CartPole-v1")
    episodes = _check_episodes(result, "CartPole-v1", (0, 1, 2, 3), (2.4, 12.0))
    assert workflow.workers.counts == {"frames_saved": 2, "frames_dropped": 0}
    assert sorted(p.name for p in RunPaths(run_dir).frames.iterdir()) == sorted(
        f"{session}.gif" for session, _ in episodes
    )
    # What the env showed: a frame at reset and after each push, 600x400 saved as
    # 240x160, each like the env's own render of the replayed state.
    renderer = gymnasium.make("CartPole-v1", render_mode="rgb_array").unwrapped
    for session, observations in episodes:
        frames = _read_gif(frame_file(RunPaths(run_dir).frames, session))
        assert len(frames) == 1 + STEPS
        assert all(f.size == (240, 160) for f in frames)
        for frame, observation in zip(frames, observations, strict=True):
            renderer.state = observation
            expected = Image.fromarray(renderer.render())
            expected.thumbnail((240, 240))
            difference = np.abs(np.asarray(frame, float) - np.asarray(expected, float))
            assert difference.mean() < 2.0  # the GIF's palette, nothing else
        assert np.asarray(frames[0]).tolist() != np.asarray(frames[-1]).tolist()


def _mujoco_renders() -> str | None:
    """Why MuJoCo cannot render here, or None."""
    if importlib.util.find_spec("mujoco") is None:
        return "mujoco is not installed: pip install 'looprl[envs]'"
    if choose_mujoco_gl(os.environ, find_renderers()) in (None, "glfw"):
        return "nothing renders headless here (no EGL vendor library, no OSMesa)"
    return None


WHY_NOT_MUJOCO = _mujoco_renders()
needs_mujoco = pytest.mark.skipif(WHY_NOT_MUJOCO is not None, reason=str(WHY_NOT_MUJOCO))


@needs_mujoco
async def test_inverted_pendulum_in_words_with_its_frames(pole_model_dir, tmp_path):
    result, workflow, run_dir = await _play(pole_model_dir, tmp_path, "InvertedPendulum-v5")
    episodes = _check_episodes(result, "InvertedPendulum-v5", (0, 2, 1, 3), (1.0, 11.5))
    assert workflow.workers.counts == {"frames_saved": 2, "frames_dropped": 0}
    for session, _ in episodes:
        frames = _read_gif(frame_file(RunPaths(run_dir).frames, session))
        assert len(frames) == 1 + STEPS and all(f.size == (240, 240) for f in frames)
        assert np.asarray(frames[0]).std() > 10  # a scene, not a blank frame


@needs_mujoco
async def test_a_render_that_fails_is_diagnosed_and_the_episodes_go_on(
    pole_model_dir, tmp_path, monkeypatch, caplog, capfd
):
    # EGL asked for, and glvnd pointed at no vendor library (as on a GPU machine without
    # the NVIDIA driver's EGL): MuJoCo cannot make a GL context at the first render.
    monkeypatch.setenv("MUJOCO_GL", "egl")
    monkeypatch.setenv("__EGL_VENDOR_LIBRARY_FILENAMES", str(tmp_path / "no_vendor.json"))
    with caplog.at_level(logging.INFO, logger="looprl.envs"):
        result, workflow, run_dir = await _play(pole_model_dir, tmp_path, "InvertedPendulum-v5")
    _check_episodes(result, "InvertedPendulum-v5", (0, 2, 1, 3), (1.0, 11.5))
    assert workflow.workers.counts == {"frames_failed": 2}
    assert not RunPaths(run_dir).frames.exists()
    (warning,) = [r.getMessage() for r in caplog.records if "were not saved" in r.getMessage()]
    assert "episodes go on without them; later ones are counted as frames_failed" in warning
    diagnosis = "looprl doctor says: MUJOCO_GL: MUJOCO_GL=egl but glvnd finds no EGL vendor"
    assert diagnosis in warning
    assert "fix: unset MUJOCO_GL so that env workers pick what renders here" in warning
    summary = "frames of 0 episodes saved, 0 frames dropped past env.frames_max_per_episode"
    assert f"{summary}, 2 recorded episodes left without frames" in caplog.text
    assert "Traceback" not in capfd.readouterr().err  # the workers' stderr


@needs_mujoco
@pytest.mark.skipif(find_renderers().osmesa, reason="libOSMesa is installed here")
def test_a_mujoco_gl_without_its_library_fails_at_start_with_the_diagnosis(monkeypatch):
    # MUJOCO_GL=osmesa breaks `import mujoco` when libOSMesa is missing, frames or not.
    monkeypatch.setenv("MUJOCO_GL", "osmesa")
    workers = EnvWorkers("gymnasium:InvertedPendulum-v5", {}, 1, 30.0)
    with pytest.raises(ValueError, match="could not be built") as error:
        workers.start()
    message = str(error.value)
    assert "looprl doctor says: MUJOCO_GL: MUJOCO_GL=osmesa but libOSMesa is not" in message
    assert "apt install libosmesa6" in message
