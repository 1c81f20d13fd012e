"""The viewer's reader on real files: metrics lines, a record being written, caching by
file change, a step's JSON, search and its filters, and the errors that name a file."""

from __future__ import annotations

import json
import math

import pytest

from looprl.runs.trajectories import TrajectoryFileError, step_path, write_step
from looprl.viewer.run_reader import RunReader, read_metrics
from tests.support.synthetic_run import trajectory_rows, write_synthetic_run


@pytest.fixture
def run_dir(tmp_path):
    return write_synthetic_run(tmp_path / "run", steps=4, rows_per_step=16, tokens_per_row=60)


def test_metrics_become_columns_and_a_bad_line_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"kind": "eval", "step": 0, "time": 1.0, "accuracy": 0.5}\n'
        '{"kind": "train", "step": 1, "time": 2.0, "loss": 0.1, "errors": {"E": 1}}\n'
        "not json\n"
        '{"kind": "train", "step": 2, "time": 3.0, "loss": null, "kl": 0.2}\n'
        '["a list"]\n'
        '{"kind": "train", "step": 3, "time": 4.0, "lo'  # being appended
    )
    metrics = read_metrics(path)
    assert metrics["columns"]["train"] == {
        "step": [1, 2],
        "time": [2.0, 3.0],
        "loss": [0.1, None],
        "kl": [None, 0.2],
    }
    assert metrics["columns"]["eval"] == {"step": [0], "time": [1.0], "accuracy": [0.5]}
    assert [e.split(":")[0] for e in metrics["errors"]] == [
        "metrics.jsonl line 3",
        "metrics.jsonl line 5",
    ]


def test_a_multi_turn_runs_keys_are_columns_and_a_word_a_step_lacks_is_null(tmp_path):
    """The page's turns panel reads these columns: turn{k}_* and action_share_<word>,
    null where a step did not log them (the page counts a missing share as 0)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"kind": "train", "step": 1, "turn1_entropy": 1.5, "action_share_go": 0.6, '
        '"action_share_other": 0.4}\n'
        '{"kind": "train", "step": 2, "turn1_entropy": 1.4, "turn2_entropy": 1.2, '
        '"action_share_look": 1.0, "action_share_other": 0.0}\n'
    )
    train = read_metrics(path)["columns"]["train"]
    assert train == {
        "step": [1, 2],
        "turn1_entropy": [1.5, 1.4],
        "action_share_go": [0.6, None],
        "action_share_other": [0.4, 0.0],
        "turn2_entropy": [None, 1.2],
        "action_share_look": [None, 1.0],
    }


def test_the_overview_is_read_again_only_when_a_file_changed(run_dir):
    reader = RunReader(run_dir)
    first = reader.overview()
    assert reader.overview() is first  # nothing changed: the same bytes
    body = json.loads(first)
    assert body["steps"] == [1, 2, 3, 4]
    assert body["total_steps"] == 4 and body["finished"]
    assert len(body["metrics"]["train"]["reward_mean"]) == 4

    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"kind": "train", "step": 5, "time": 9.0, "reward_mean": 1.0}) + "\n")
    write_step(run_dir, 5, trajectory_rows(5, 8, 8, 60))
    body = json.loads(reader.overview())
    assert body["metrics"]["train"]["reward_mean"][-1] == 1.0
    assert body["steps"] == [1, 2, 3, 4, 5]


def test_a_step_is_json_with_logprobs_only_on_the_mask(run_dir):
    reader = RunReader(run_dir)
    body = json.loads(reader.step(2))
    rows = body["rows"]
    assert body["file"] == "trajectories/step_000002.parquet" and body["warnings"] == []
    assert [r["index"] for r in rows] == list(range(16))
    row = rows[1]
    assert row["calls"][0]["completion_id"] == "c2-1-0"  # JSON columns parsed
    for i, masked in enumerate(row["loss_mask"]):
        assert (row["engine_logprobs"][i] is None) == (not masked)
    assert rows[0]["trainer_logprobs"] is None  # the synthetic error row has none
    assert reader.step(2) is reader.step(2)  # cached until the file changes


def test_a_non_finite_logprob_becomes_null(run_dir):
    rows = trajectory_rows(7, 8, 8, 60)
    rows[0]["engine_logprobs"][50] = math.nan
    write_step(run_dir, 7, rows)
    body = json.loads(RunReader(run_dir).step(7))  # strict JSON: no NaN
    assert body["rows"][0]["engine_logprobs"][50] is None


def test_unreadable_step_files_name_themselves(run_dir):
    reader = RunReader(run_dir)
    step_path(run_dir, 3).write_bytes(b"garbage")
    with pytest.raises(TrajectoryFileError, match=r"step_000003.parquet: not a readable Parquet"):
        reader.step(3)
    with pytest.raises(FileNotFoundError, match="step_000009.parquet"):
        reader.step(9)
    body = json.loads(reader.search("needle", set()))
    assert body["errors"][0].startswith("trajectories/step_000003.parquet")
    assert body["scanned_steps"] == 3


def test_search_matches_text_and_every_flag_given(run_dir):
    reader = RunReader(run_dir)
    hits = json.loads(reader.search("NEEDLE2X1", set()))["hits"]  # any case
    assert [(h["step"], h["index"]) for h in hits] == [(2, i) for i in [1, *range(10, 16)]]
    assert "needle2x1" in hits[0]["snippet"]
    both = json.loads(reader.search("", {"errors", "truncated"}))["hits"]
    assert [(h["step"], h["index"]) for h in both] == [(s, 0) for s in range(1, 5)]
    with pytest.raises(ValueError, match="unknown filter"):
        reader.search("", {"bogus"})


def test_config_values_json_lacks_still_show(run_dir):
    (run_dir / "config.yaml").write_text("train:\n  max_grad_norm: .inf\n  started: 2026-11-26\n")
    config = json.loads(RunReader(run_dir).overview())["config"]
    assert config == {"train": {"max_grad_norm": "inf", "started": "2026-11-26"}}


def test_warnings_are_kept_for_the_banner_and_not_taken_for_bad_lines(tmp_path):
    """Records of kind "warning" (diagnostics/learning.py's, through Metrics.log_warnings)
    go to the overview's warnings, in order, not into the columns nor the errors."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"kind": "train", "step": 1, "time": 2.0, "loss": 0.1}\n'
        '{"kind": "warning", "step": 1, "time": 2.1, "name": "truncated", "message": "cut"}\n'
        '{"kind": "warning", "step": 5, "time": 6.0, "name": "equal_rewards", "message": "eq"}\n'
    )
    metrics = read_metrics(path)
    assert metrics["columns"]["train"] == {"step": [1], "time": [2.0], "loss": [0.1]}
    assert metrics["warnings"] == [
        {"step": 1, "name": "truncated", "message": "cut"},
        {"step": 5, "name": "equal_rewards", "message": "eq"},
    ]
    assert metrics["errors"] == []
