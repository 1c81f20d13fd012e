"""The warm-start chats of examples/envs: a FrozenLake walker's shortest walks, and a run's
successful rollouts read back from real trajectory files.

The walker's chats are replayed in a fresh env: each move must shorten the walk to the
goal by one (breadth-first distances), each episode must end at the goal in the map's
shortest number of moves, and each chat's messages must be what EnvWorkflow sends for
that turn; only training seeds may be played.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from examples.envs.frozen_lake_chats import GymnasiumEnv, shortest_moves, write_chats
from examples.envs.successful_chats import successful_chats
from looprl.config import load_config
from looprl.envs.gymnasium import walking_distances
from looprl.runs.trajectories import SCHEMA, write_step
from looprl.tasks.env_seeds import HELD_OUT_OFFSET
from looprl.training.sft_data import load_chats
from looprl.workflows.env import EnvWorkflow

GOAL_CONFIG = Path(__file__).parents[2] / "examples" / "envs" / "frozen_lake_goal.yaml"
MAPS = 12


@pytest.fixture
def reset_seeds(monkeypatch) -> list[int]:
    """Every seed a GymnasiumEnv is reset with, in order."""
    seeds: list[int] = []
    reset = GymnasiumEnv.reset

    def spy(self, seed, options=None):
        seeds.append(seed)
        return reset(self, seed, options)

    monkeypatch.setattr(GymnasiumEnv, "reset", spy)
    return seeds


def _config(tmp_path: Path, **env: object) -> Path:
    """frozen_lake_goal.yaml with `env` fields changed."""
    data = yaml.safe_load(GOAL_CONFIG.read_text())
    data["env"].update(env)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _replay(config: Path, chats: list[dict], ties: str) -> int:
    """Play each chat's move from map 0 on, a map after another as its walk reaches the
    goal; check each move (with ties "first", the first shortest in the action order) and
    each chat's messages. Returns the maps walked."""
    cfg = load_config(config)
    env = GymnasiumEnv("FrozenLake-v1", **cfg.env.kwargs)
    workflow = EnvWorkflow(**{**cfg.env.model_dump(), "workers": 1})
    seed, done = -1, True
    try:
        for chat in chats:
            *sent, reply = chat["messages"]
            if done:  # the next map
                seed += 1
                prompt, turns, moves = env.reset(seed), [], 0
                desc = env.env.unwrapped.desc
                distances = walking_distances(desc)
                cols = desc.shape[1]
            assert sent == workflow.messages(turns, prompt)
            assert sent[0] == {"role": "system", "content": cfg.env.system_prompt}
            assert reply["role"] == "assistant"
            before = distances[divmod(int(env.state), cols)]
            shortest = [
                word
                for word in ("left", "down", "right", "up")
                if distances.get(_after(divmod(int(env.state), cols), word)) == before - 1
            ]
            if ties == "first":
                assert reply["content"] == shortest[0]
            prompt, _, done, info = env.step(reply["content"])
            after = distances.get(divmod(int(env.state), cols))
            assert after == before - 1, (seed, reply["content"], before, after)
            turns.append((sent[-1]["content"], reply["content"]))
            moves += 1
            if done:
                assert info["success"] and moves == distances[(0, 0)]
    finally:
        workflow.close()
    assert done, "the last map's walk stops before the goal"
    return seed + 1


def _after(tile: tuple[int, int], word: str) -> tuple[int, int]:
    dr, dc = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}[word]
    return tile[0] + dr, tile[1] + dc


def test_each_move_is_a_shortest_walk_step_on_training_maps(tmp_path, reset_seeds):
    out = tmp_path / "chats.jsonl"
    walked, written = write_chats(GOAL_CONFIG, MAPS, out, ties="first")
    chats = [json.loads(line) for line in out.open()]
    assert walked == MAPS and written == len(chats) >= 4 * MAPS  # 3x3: at least 4 moves
    assert reset_seeds[:MAPS] == list(range(MAPS))  # task.seed 0's first training maps
    assert all(seed < HELD_OUT_OFFSET for seed in reset_seeds)
    assert _replay(GOAL_CONFIG, chats, ties="first") == MAPS
    assert all(len(chat["messages"]) == 3 for chat in chats)  # history_turns 0
    moves = {chat["messages"][-1]["content"] for chat in chats}
    assert moves <= {"down", "right"} and len(moves) == 2


def test_random_ties_draw_each_equally_short_move(tmp_path):
    out = tmp_path / "chats.jsonl"
    write_chats(GOAL_CONFIG, MAPS, out, ties="random")
    chats = [json.loads(line) for line in out.open()]
    assert _replay(GOAL_CONFIG, chats, ties="random") == MAPS
    # The start (row 1, column 1) of a map without a hole beside it offers down and right.
    starts = [c["messages"][-1]["content"] for c in chats if "row 1, column 1 " in str(c)]
    assert len(starts) == MAPS and set(starts) == {"down", "right"}
    again = tmp_path / "again.jsonl"
    write_chats(GOAL_CONFIG, MAPS, again, ties="random")
    assert again.read_text() == out.read_text()  # seeded by the map


def test_history_turns_are_rendered_as_the_workflow_renders_them(tmp_path):
    config = _config(tmp_path, history_turns=2, system_prompt="Walk.")
    out = tmp_path / "chats.jsonl"
    write_chats(config, 3, out, ties="random")
    chats = [json.loads(line) for line in out.open()]
    assert _replay(config, chats, ties="random") == 3
    # The fourth turn of a 4-move walk shows its two previous turns, with their replies.
    assert [len(chat["messages"]) for chat in chats[:4]] == [3, 5, 7, 7]
    assert chats[3]["messages"][3] == chats[2]["messages"][-2]
    assert chats[3]["messages"][4] == chats[2]["messages"][-1]


def test_the_chats_load_as_sft_data(tmp_path, smol_model_dir):
    from looprl.models import load_tokenizer

    out = tmp_path / "chats.jsonl"
    write_chats(GOAL_CONFIG, 2, out)
    tokenizer = load_tokenizer(smol_model_dir)
    chats = load_chats(out, tokenizer, max_tokens=512)
    replies = [json.loads(line)["messages"][-1]["content"] for line in out.open()]
    assert chats.skipped == [] and len(chats.trajectories) == len(replies)
    for trajectory, reply in zip(chats.trajectories, replies, strict=True):
        trained = tokenizer.decode(trajectory.input_ids[trajectory.loss_mask])
        assert trained.startswith(reply) and trained != reply  # the move, then end of turn


def test_no_move_where_the_goal_cannot_be_reached():
    env = GymnasiumEnv("FrozenLake-v1", desc=["SFH", "FFH", "HHG"])
    env.reset(0)
    assert shortest_moves(env) == []
    env = GymnasiumEnv("FrozenLake-v1", desc=["SHF", "FFF", "HFG"])
    env.reset(0)
    assert shortest_moves(env) == ["down"]  # right is a hole
    env.step("down")
    assert shortest_moves(env) == ["right"]  # down is a hole, left the edge
    env = GymnasiumEnv("FrozenLake-v1", desc=["SFF", "FFF", "FFG"])
    env.reset(0)
    assert shortest_moves(env) == ["down", "right"]


def _call(user: str, reply: str, reward: float | None) -> dict:
    return {
        "completion_id": f"c-{user}",
        "messages": [{"role": "system", "content": "Walk."}, {"role": "user", "content": user}],
        "reply": reply,
        "tool_calls": None,
        "finish_reason": "stop",
        "reward": reward,
        "started_s": 0.0,
        "ended_s": 0.0,
    }


def _rows(step: int, session: str, calls: list[dict]) -> list[dict]:
    """A rollout trained as one sample per call, as trajectories.step_rows writes it: each
    row the rollout's calls."""
    row = dict.fromkeys(SCHEMA.names)
    row.update(step=step, policy_version=step - 1, session_id=session, group_id="g")
    row.update(calls=json.dumps(calls), concat_breaks="[]", timings="{}")
    return [{**row, "reward": call["reward"] or 0.0} for call in calls]


def test_successful_chats_keep_each_successful_rollouts_calls_once(tmp_path):
    won = [_call("at 1,1", "down", 0.25), _call("at 2,1", "right", 0.5), _call("x", "r", 1.0)]
    lost = [_call("at 1,1", "up", 0.0), _call("at 1,1", "left", 0.0)]
    short = [_call("at 1,1", "right", 0.5)]
    empty_last = [_call("at 1,1", "down", 1.0), _call("at 2,1", "", None)]
    later = [_call("at 3,2", "right", 1.2)]
    write_step(tmp_path, 1, _rows(1, "won", won) + _rows(1, "lost", lost))
    write_step(tmp_path, 2, _rows(2, "short", short) + _rows(2, "empty", empty_last))
    write_step(tmp_path, 3, _rows(3, "later", later))

    chats, rollouts = successful_chats(tmp_path, min_reward=1.0)
    assert rollouts == 5
    expected = [*won, empty_last[0], *later]
    assert chats == [
        {"messages": [*c["messages"], {"role": "assistant", "content": c["reply"]}]}
        for c in expected
    ]
    chats, _ = successful_chats(tmp_path, min_reward=0.5)
    replies = [c["messages"][-1]["content"] for c in chats]
    assert replies == ["down", "right", "r", "right", "down", "right"]  # won, short, empty, later
    with pytest.raises(FileNotFoundError, match="no trajectory files"):
        successful_chats(tmp_path / "empty", 1.0)
