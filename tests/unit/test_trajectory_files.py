import json
import logging
import math
import tomllib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from packaging.version import Version

from looprl.config import MetricsConfig
from looprl.runs.trajectories import (
    SCHEMA,
    TrajectoryFileError,
    TrajectoryWriter,
    list_steps,
    prune,
    read_step,
    step_path,
    step_rows,
    write_step,
)
from looprl.training.batch import build_batch
from tests.support.trajectory_step import step_fixture, token_text

# The contract with the viewer, written out: these names, types and order.
COLUMNS = [
    ("step", "int64"),
    ("policy_version", "int64"),
    ("session_id", "string"),
    ("group_id", "string"),
    ("row_id", "string"),
    ("sample_index", "int64"),
    ("reward", "double"),
    ("advantage", "double"),
    ("staleness", "int64"),
    ("truncated", "bool"),
    ("error", "string"),
    ("text", "string"),
    ("token_ids", "list<element: int64>"),
    ("token_text", "list<element: string>"),
    ("loss_mask", "list<element: bool>"),
    ("engine_logprobs", "list<element: float>"),
    ("trainer_logprobs", "list<element: float>"),
    ("token_versions", "list<element: int64>"),
    ("calls", "string"),
    ("concat_breaks", "string"),
    ("timings", "string"),
]


def test_the_file_has_exactly_the_viewers_schema(tmp_path):
    rollout, batch, trainer = step_fixture()
    path = write_step(tmp_path, 3, step_rows(3, 4, rollout, batch, trainer, token_text))
    assert path == tmp_path / "trajectories" / "step_000003.parquet"
    schema = pq.read_schema(path)
    assert [(f.name, str(f.type)) for f in schema] == COLUMNS
    assert schema.equals(SCHEMA)


def test_rows_round_trip_with_each_rows_own_advantage(tmp_path):
    rollout, batch, trainer = step_fixture()
    write_step(tmp_path, 3, step_rows(3, 4, rollout, batch, trainer, token_text))
    rows = read_step(step_path(tmp_path, 3))

    assert [r["session_id"] for r in rows] == ["sA", "sA", "sB", "sC"]
    assert [r["group_id"] for r in rows] == ["g1", "g1", "g1", "g2"]
    assert [r["sample_index"] for r in rows] == [0, 0, 1, 0]
    assert [r["row_id"] for r in rows] == ["7", "7", "7", "8"]
    assert [r["reward"] for r in rows] == [1.0, 1.0, 0.0, 0.5]
    # g1 rewards (1, 1, 0): mean 2/3, unbiased std 1/sqrt(3); g2 alone: 0.
    assert [r["advantage"] for r in rows] == pytest.approx(
        [1 / math.sqrt(3), 1 / math.sqrt(3), -2 / math.sqrt(3), 0.0], rel=1e-5
    )
    assert [r["staleness"] for r in rows] == [1, 0, 0, 0]  # A1 sampled at version 3
    assert all(r["step"] == 3 and r["policy_version"] == 4 for r in rows)

    a1 = rows[0]
    assert a1["token_ids"] == [1, 2, 5, 6]
    assert a1["token_text"] == ["<1>", "<2>", "<5>", "<6>"]
    assert a1["loss_mask"] == [False, False, True, True]
    assert a1["engine_logprobs"] == [0.0, 0.0, -0.5, -0.5]
    assert a1["trainer_logprobs"] == [0.0, 0.0, -0.25, -0.25]  # 0 off the mask
    assert a1["token_versions"] == [-1, -1, 3, 3]
    assert rows[1]["token_ids"] == [1, 9, 9, 8]
    assert rows[2]["trainer_logprobs"] is None  # a NaN at a sampled token
    assert a1["truncated"] is False and a1["error"] is None

    # The rollout's calls and its break, on both of its rows; JSON parsed by read_step.
    assert a1["calls"] == rows[1]["calls"]
    assert [c["completion_id"] for c in a1["calls"]] == ["a1", "a2"]
    assert a1["calls"][0] == {
        "completion_id": "a1",
        "messages": [{"role": "user", "content": "hello"}],
        "reply": "reply a1",
        "tool_calls": [],
        "finish_reason": "stop",
        "reward": 1.0,
        "started_s": 100.0,
        "ended_s": 101.5,
        "max_tokens": None,  # Interactions built by hand: no token limit recorded
        "requested_max_tokens": None,
    }
    assert len(a1["concat_breaks"]) == 1 and "call 2" in a1["concat_breaks"][0]
    assert rows[2]["concat_breaks"] == [] and rows[2]["calls"][0]["messages"] == []
    assert a1["timings"]["rollout_s"] == 2.0 and a1["timings"]["wait_s"] > 0
    # The raw columns are JSON strings.
    raw = pq.read_table(step_path(tmp_path, 3)).column("timings").to_pylist()
    assert json.loads(raw[0])["rollout_s"] == 2.0


def test_trainer_logprobs_are_null_when_the_trainer_computed_none(tmp_path):
    rollout, batch, _ = step_fixture()
    write_step(tmp_path, 1, step_rows(1, 4, rollout, batch, None, token_text))
    assert [r["trainer_logprobs"] for r in read_step(step_path(tmp_path, 1))] == [None] * 4


def test_rows_must_be_the_batchs(tmp_path):
    rollout, _, _ = step_fixture()
    other, _ = build_batch(rollout.trajectories[:3], "grpo", pad_token_id=0)
    with pytest.raises(ValueError, match="3 rows"):
        step_rows(1, 4, rollout, other, None, token_text)


def test_prune_deletes_the_oldest_files_past_the_cap(tmp_path):
    rollout, batch, trainer = step_fixture()
    for step in (1, 2, 3, 4):
        write_step(tmp_path, step, step_rows(step, 4, rollout, batch, trainer, token_text))
    size = step_path(tmp_path, 4).stat().st_size
    assert prune(tmp_path, max_bytes=4 * size + 100) == 0
    assert prune(tmp_path, max_bytes=2 * size + 100) == 2
    assert [s for s, _ in list_steps(tmp_path)] == [3, 4]
    assert prune(tmp_path, max_bytes=1) == 1  # the newest file is always kept
    assert [s for s, _ in list_steps(tmp_path)] == [4]


class FakeTrainer:
    """The two things the writer asks of a trainer handle."""

    def __init__(self, logprobs):
        self.logprobs, self.version = logprobs, 5

    async def step_logprobs(self):
        return self.logprobs


def tokenizer():
    from types import SimpleNamespace

    return SimpleNamespace(batch_decode=lambda seqs: [f"<{s[0]}>" for s in seqs])


async def test_writer_writes_due_steps_and_reports_pruned_files(tmp_path):
    rollout, batch, trainer = step_fixture()
    cfg = MetricsConfig(trajectories_every=2, trajectories_max_mb=1e-6)  # about 1 byte
    writer = TrajectoryWriter(tmp_path, cfg, tokenizer())
    stats = [await writer.write(s, rollout, batch, FakeTrainer(trainer)) for s in (1, 2, 3, 4)]
    assert [s for s, _ in list_steps(tmp_path)] == [4]
    assert [s["trajectories_pruned"] for s in stats] == [0, 0, 0, 1]
    assert all(s["trajectories_write_errors"] == 0 for s in stats)
    rows = read_step(step_path(tmp_path, 4))
    assert rows[0]["policy_version"] == 4 and rows[0]["token_text"][0] == "<1>"


async def test_writer_is_off_at_zero(tmp_path):
    rollout, batch, trainer = step_fixture()
    writer = TrajectoryWriter(tmp_path, MetricsConfig(trajectories_every=0), tokenizer())
    assert await writer.write(1, rollout, batch, FakeTrainer(trainer)) == {}
    assert list_steps(tmp_path) == []


async def test_a_failed_write_keeps_the_old_file_and_is_counted_not_raised(
    tmp_path, monkeypatch, caplog
):
    rollout, batch, trainer = step_fixture()
    writer = TrajectoryWriter(tmp_path, MetricsConfig(), tokenizer())
    await writer.write(1, rollout, batch, FakeTrainer(trainer))
    before = step_path(tmp_path, 1).read_bytes()

    def disk_full(table, where, **kw):
        with open(where, "wb") as f:
            f.write(b"PAR1 half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq, "write_table", disk_full)
    with caplog.at_level(logging.WARNING, logger="looprl.runs.trajectories"):
        for _ in range(2):
            stats = await writer.write(1, rollout, batch, FakeTrainer(trainer))
    assert stats["trajectories_write_errors"] == 2
    assert len(caplog.records) == 1  # logged once
    assert "No space left on device" in caplog.records[0].getMessage()
    assert step_path(tmp_path, 1).read_bytes() == before  # the old file, whole
    assert sorted(p.name for p in (tmp_path / "trajectories").iterdir()) == [
        "step_000001.parquet"
    ]  # no temporary file left


def test_a_corrupt_file_raises_naming_it(tmp_path):
    path = step_path(tmp_path, 2)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not parquet at all")
    with pytest.raises(TrajectoryFileError, match="step_000002.parquet"):
        read_step(path)

    pq.write_table(pa.table({"step": [1]}), path)  # Parquet, but not ours
    with pytest.raises(
        TrajectoryFileError, match=r"step_000002\.parquet.*no column policy_version"
    ):
        read_step(path)


def test_list_steps_ignores_temporary_and_other_files(tmp_path):
    folder = tmp_path / "trajectories"
    folder.mkdir()
    for name in ("step_000010.parquet", "step_000002.parquet", ".step_000011.parquet.9.tmp"):
        (folder / name).write_bytes(b"")
    (folder / "notes.txt").write_text("")
    assert list_steps(tmp_path) == [
        (2, folder / "step_000002.parquet"),
        (10, folder / "step_000010.parquet"),
    ]
    assert list_steps(tmp_path / "missing") == []


def test_a_new_run_sets_earlier_files_aside_and_a_resumed_one_drops_redone_steps(tmp_path):
    rollout, batch, trainer = step_fixture()
    for step in (1, 2, 3):
        write_step(tmp_path, step, step_rows(step, 4, rollout, batch, trainer, token_text))
    TrajectoryWriter(tmp_path, MetricsConfig(), tokenizer(), first_step=3)  # resumed after 2
    assert [s for s, _ in list_steps(tmp_path)] == [1, 2]

    TrajectoryWriter(tmp_path, MetricsConfig(), tokenizer(), first_step=1)  # a new run
    assert list_steps(tmp_path) == []
    (aside,) = tmp_path.glob("trajectories.replaced-*")
    assert sorted(p.name for p in aside.iterdir()) == [
        "step_000001.parquet",
        "step_000002.parquet",
    ]


def test_pyarrow_is_one_that_reads_parquet_without_running_code():
    """pyarrow 0.14 to 14.0.0 unpickles what a crafted Parquet file holds (CVE-2023-47248),
    and `looprl view` and `looprl show` read Parquet files from run dirs."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    assert "pyarrow>=14.0.1" in dependencies
    assert Version(pa.__version__) >= Version("14.0.1")
