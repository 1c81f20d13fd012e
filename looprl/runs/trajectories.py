"""Trajectory files: the rollouts each training step trained on, as Parquet in the run dir.

Owns the file format (`SCHEMA`; one file per step in the run's trajectories folder,
`RunPaths.trajectories`, named `step_000012.parquet`, one row per trajectory trained on,
in the batch's order), writing it atomically (`atomic_write`, looprl/runs/atomic.py: a
hidden temporary file, then `os.replace`; not fsynced) every
`metrics.trajectories_every` steps, pruning the oldest files past
`metrics.trajectories_max_mb`, and reading the files back (`list_steps`, `read_step`)
for `looprl show` and the viewer. Each function takes the run directory (its root or
its RunPaths). Does not decide what is
trained: the rows are the step's RolloutResult trajectories, aligned with its TrainBatch.

Columns (JSON columns hold strings, which `read_step` parses):

- step, policy_version (the trainer's version the step trained from): int64
- session_id, group_id, row_id (the dataset row's "id", else its position in the data
  stream), sample_index (the rollout's index in its group): strings, int64
- reward (the trajectory's, before overlong shaping), advantage (its batch row's),
  staleness (policy_version minus the oldest version of its sampled tokens)
- truncated (a call stopped at its token limit), error (null: none)
- text (the sequence decoded), token_ids, token_text (each token decoded alone),
  loss_mask (True on the tokens the policy sampled; a row that train.overlong leaves out
  keeps its mask and has advantage 0), engine_logprobs (0.0 off the mask),
  trainer_logprobs (0.0 off the mask; null for a row the trainer computed none for, see
  `TrainerHandle.step_logprobs`), token_versions (-1 off the mask)
- calls: JSON list of the rollout's chat calls (`trajectory.call_records`), concat_breaks:
  JSON list of sentences, timings: JSON object (rollout_s; wait_s, from the rollout's
  end to the end of the step that trained it)
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from looprl.runs.atomic import atomic_write
from looprl.runs.paths import RunPaths

if TYPE_CHECKING:  # the reader (`looprl show`) needs neither torch nor the trainer
    import torch

    from looprl.config import MetricsConfig
    from looprl.rollout.outcome import RolloutResult
    from looprl.scheduling.parts import TrainerHandle
    from looprl.training.batch import TrainBatch

log = logging.getLogger(__name__)


def _list(item: pa.DataType) -> pa.ListType:
    """A list column, its items named as Parquet files name them (so that the schema
    read back equals this one)."""
    return pa.list_(pa.field("element", item))


SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("policy_version", pa.int64()),
        ("session_id", pa.string()),
        ("group_id", pa.string()),
        ("row_id", pa.string()),
        ("sample_index", pa.int64()),
        ("reward", pa.float64()),
        ("advantage", pa.float64()),
        ("staleness", pa.int64()),
        ("truncated", pa.bool_()),
        ("error", pa.string()),
        ("text", pa.string()),
        ("token_ids", _list(pa.int64())),
        ("token_text", _list(pa.string())),
        ("loss_mask", _list(pa.bool_())),
        ("engine_logprobs", _list(pa.float32())),
        ("trainer_logprobs", _list(pa.float32())),
        ("token_versions", _list(pa.int64())),
        ("calls", pa.string()),
        ("concat_breaks", pa.string()),
        ("timings", pa.string()),
    ]
)
JSON_COLUMNS = ("calls", "concat_breaks", "timings")
_STEP_FILE = re.compile(r"^step_(\d+)\.parquet$")


class TrajectoryFileError(Exception):
    """A trajectory file that cannot be read, or a run dir without any."""


def trajectories_dir(run_dir: Path | RunPaths) -> Path:
    return RunPaths.of(run_dir).trajectories


def step_path(run_dir: Path | RunPaths, step: int) -> Path:
    return trajectories_dir(run_dir) / f"step_{step:06d}.parquet"


def list_steps(run_dir: Path | RunPaths) -> list[tuple[int, Path]]:
    """The run's trajectory files as (step, path), oldest step first."""
    folder = trajectories_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(_STEP_FILE.match(p.name), p) for p in folder.iterdir()]
    return sorted((int(m.group(1)), p) for m, p in found if m)


def step_rows(
    step: int,
    policy_version: int,
    rollout: RolloutResult,
    batch: TrainBatch,
    trainer_logprobs: torch.Tensor | None,
    token_text: Callable[[list[int]], list[str]],
) -> list[dict[str, Any]]:
    """One row per trajectory of `rollout`, in `batch`'s row order (build_batch's input
    is `rollout.trajectories`), as `SCHEMA` describes; `trainer_logprobs` (N, T) float32
    with NaN where the trainer computed none, or None."""
    if len(rollout.trajectories) != batch.num_sequences:
        raise ValueError(
            f"step {step}: {len(rollout.trajectories)} trajectories for a batch of "
            f"{batch.num_sequences} rows; the batch must be built from rollout.trajectories"
        )
    now = time.monotonic()
    rows: list[dict[str, Any]] = []
    for outcome in rollout.outcomes:
        timings = {
            "rollout_s": outcome.elapsed_s,
            "wait_s": now - (outcome.started + outcome.elapsed_s),
        }
        for t in outcome.trajectories:
            i, n = len(rows), t.num_tokens
            ids = t.input_ids.tolist()
            mask = t.loss_mask
            trainer = None
            if trainer_logprobs is not None:
                row = trainer_logprobs[i, :n]
                if not bool(row[mask].isnan().any()):
                    trainer = row.masked_fill(~mask, 0.0).tolist()
            rows.append(
                {
                    "step": step,
                    "policy_version": policy_version,
                    "session_id": t.session_id,
                    "group_id": t.group_id,
                    "row_id": outcome.row_id,
                    "sample_index": outcome.sample_index,
                    "reward": t.reward,
                    "advantage": float(batch.advantages[i]),
                    "staleness": policy_version - t.oldest_version(),
                    "truncated": t.truncated,
                    "error": outcome.error,
                    "text": t.text,
                    "token_ids": ids,
                    "token_text": token_text(ids),
                    "loss_mask": mask.tolist(),
                    "engine_logprobs": t.behavior_logprobs.tolist(),
                    "trainer_logprobs": trainer,
                    "token_versions": t.versions.tolist(),
                    "calls": json.dumps(outcome.calls),
                    "concat_breaks": json.dumps(outcome.concat_breaks),
                    "timings": json.dumps(timings),
                }
            )
    return rows


def write_step(run_dir: Path | RunPaths, step: int, rows: list[dict[str, Any]]) -> Path:
    """Write `rows` as the step's file, atomically (`atomic_write`): a reader sees the
    whole file or none."""
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    return atomic_write(
        step_path(run_dir, step), lambda tmp: pq.write_table(table, tmp, compression="zstd")
    )


def prune(run_dir: Path | RunPaths, max_bytes: float) -> int:
    """Delete the oldest step files until the rest fit in `max_bytes` (the newest is
    always kept); returns how many were deleted."""
    files = [path for _, path in list_steps(run_dir)]
    sizes = [path.stat().st_size for path in files]
    total, deleted = sum(sizes), 0
    for path, size in zip(files[:-1], sizes[:-1], strict=True):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        total, deleted = total - size, deleted + 1
    return deleted


def read_step(path: Path) -> list[dict[str, Any]]:
    """The rows of one step file, its JSON columns parsed. Raises TrajectoryFileError
    naming the file when it is not a readable trajectory file."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise TrajectoryFileError(f"{path}: not a readable Parquet file ({e})") from None
    missing = [name for name in SCHEMA.names if name not in table.column_names]
    if missing:
        raise TrajectoryFileError(
            f"{path}: not a looprl trajectory file (no column {', '.join(missing)})"
        )
    rows = table.to_pylist()
    for row in rows:
        for name in JSON_COLUMNS:
            try:
                row[name] = json.loads(row[name])
            except (TypeError, ValueError) as e:
                raise TrajectoryFileError(f"{path}: column {name} is not JSON ({e})") from None
    return rows


class TrajectoryWriter:
    """The training loop's writer: each due step's file, then pruning.

    A step is due every `metrics.trajectories_every` steps (0: never). A write that fails
    (disk full, no permission) is logged once and counted, never fatal. `write` returns
    the counts for the step's metrics, both since this process started:
    `trajectories_pruned` (files deleted to stay under metrics.trajectories_max_mb) and
    `trajectories_write_errors`.

    Files never mix runs: a new run (`first_step` 1) moves an earlier run's folder aside
    to `trajectories.replaced-<time>`, and a resumed one deletes the files of the steps
    it trains again (`first_step` on), which the interrupted run wrote.
    """

    def __init__(
        self, run_dir: Path | RunPaths, cfg: MetricsConfig, tokenizer, first_step: int = 1
    ):
        self.paths, self.cfg, self.tokenizer = RunPaths.of(run_dir), cfg, tokenizer
        self.pruned = self.errors = 0
        folder = self.paths.trajectories
        if first_step == 1 and folder.is_dir() and any(folder.iterdir()):
            aside = folder.with_name(f"trajectories.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
            folder.rename(aside)
            log.warning("Moved the trajectory files of an earlier run to %s", aside)
        for step, path in list_steps(self.paths):
            if step >= first_step:
                path.unlink()

    async def write(
        self, step: int, rollout: RolloutResult, batch: TrainBatch, trainer: TrainerHandle
    ) -> dict[str, int]:
        """Call after `trainer.train_step(batch)`, `batch` built from `rollout`, before
        the next batch may start (the loop calls it before `notify_version`).

        The rows are built and written on the event loop's thread, not in a worker
        thread: with the write in `asyncio.to_thread`, two identical seeded runs stopped
        sampling the same tokens from step 3 or so (tests/e2e/test_recovery.py), which
        they do again without it. Why the thread changed the engine's float32 numerics
        was not found."""
        every = self.cfg.trajectories_every
        if every == 0:
            return {}
        if step % every == 0:
            logprobs = await trainer.step_logprobs()
            version = trainer.version - 1  # the step's update advanced it by one
            self._write(step, version, rollout, batch, logprobs)
        return {"trajectories_pruned": self.pruned, "trajectories_write_errors": self.errors}

    def _write(self, step, version, rollout, batch, logprobs) -> None:
        rows = step_rows(step, version, rollout, batch, logprobs, self._token_text)
        try:
            write_step(self.paths, step, rows)
            self.pruned += prune(self.paths, self.cfg.trajectories_max_mb * 2**20)
        except (OSError, pa.ArrowException) as e:
            self.errors += 1
            if self.errors == 1:
                log.warning(
                    "Could not write the trajectories of step %d to %s (%s); training goes "
                    "on, later failures are counted as trajectories_write_errors. Free disk "
                    "space or set metrics.trajectories_every=0",
                    step,
                    self.paths.trajectories,
                    e,
                )

    def _token_text(self, ids: list[int]) -> list[str]:
        return self.tokenizer.batch_decode([[i] for i in ids])
