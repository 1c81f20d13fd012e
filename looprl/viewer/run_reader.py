"""Read a run directory for the viewer: config, metrics, and the trajectories of a step.

Owns: turning `config.yaml`, `metrics.jsonl` and the step files into JSON bytes for
the page, cached per file (its mtime and size, so a run in progress is read again only
where it changed), and searching the step files. Where the files are is `RunPaths`'
(looprl/runs/paths.py); the step files' format is `looprl/runs/trajectories.py`'s.
Reads only; knows nothing of HTTP.

A last line of metrics.jsonl without its newline is a record being written, not a
corrupt file: it is left for the next read.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from looprl.runs.paths import RunPaths
from looprl.runs.trajectories import (
    JSON_COLUMNS,
    SCHEMA,
    TrajectoryFileError,
    list_steps,
    step_path,
)

TOKEN_COLUMNS = (
    "token_ids",
    "token_text",
    "loss_mask",
    "engine_logprobs",
    "trainer_logprobs",
    "token_versions",
)
ROW_COLUMNS = (
    "step",
    "policy_version",
    "session_id",
    "group_id",
    "row_id",
    "sample_index",
    "reward",
    "advantage",
    "staleness",
    "truncated",
    "error",
)
SEARCH_COLUMNS = (
    "group_id",
    "session_id",
    "row_id",
    "sample_index",
    "reward",
    "staleness",
    "truncated",
    "error",
)
FLAG_COLUMNS = {"zero": "reward", "errors": "error", "truncated": "truncated", "stale": "staleness"}
FLAGS = tuple(FLAG_COLUMNS)
STEP_CACHE_SIZE = 32  # encoded steps kept (a few MB each at most)


class RunReader:
    """One run directory, read on demand. Thread-safe: the server calls it from a pool."""

    def __init__(self, run_dir: Path | RunPaths):
        self.paths = RunPaths.of(run_dir)
        self.run_dir = self.paths.root
        self.name = "/".join(self.run_dir.resolve().parts[-2:])
        self._lock = threading.Lock()
        self._files: dict[Path, tuple[tuple[int, int], Any]] = {}
        self._overview: tuple[str, bytes] | None = None
        self._steps: OrderedDict[int, tuple[tuple[int, int], bytes]] = OrderedDict()

    def stamp(self) -> str:
        """Changes whenever anything the overview shows changes."""
        paths = (
            self.run_dir,  # a file or folder appears: model/ when the run finishes
            self.paths.config,
            self.paths.metrics,
            self.paths.trajectories,
        )
        parts = [_stat_key(path) for path in paths]
        return "-".join(f"{m:x}.{s:x}" for m, s in parts)

    def overview(self) -> bytes:
        """The run as JSON: name, config, metrics by kind (columns), the run's warnings,
        step list, errors."""
        stamp = self.stamp()
        cached = self._overview
        if cached is not None and cached[0] == stamp:
            return cached[1]
        errors: list[str] = []
        config, config_text = self._read_config(errors)
        metrics = self._cached(self.paths.metrics, read_metrics, errors)
        body = {
            "name": self.name,
            "path": str(self.run_dir.resolve()),
            "stamp": stamp,
            "config": config,
            "config_text": config_text,
            "total_steps": _total_steps(config),
            "metrics": metrics["columns"] if metrics else {"train": {}, "eval": {}},
            "warnings": metrics["warnings"] if metrics else [],
            "steps": self.steps(),
            "finished": self._finished(config, metrics),
            "errors": errors + (metrics["errors"] if metrics else []),
        }
        encoded = _encode(body)
        self._overview = (stamp, encoded)
        return encoded

    def _finished(self, config: dict | None, metrics: dict | None) -> bool:
        """The model was saved, or the final evaluation (at train.total_steps) logged."""
        total = _total_steps(config)
        evals = metrics["columns"]["eval"].get("step", []) if metrics else []
        return self.paths.model.is_dir() or bool(total and evals and evals[-1] >= total)

    def steps(self) -> list[int]:
        """Steps with a trajectory file, in order."""
        return [step for step, _ in list_steps(self.paths)]

    def step(self, step: int) -> bytes:
        """Every trajectory of `step` as JSON, each with its `index` in the file; raises
        FileNotFoundError or TrajectoryFileError."""
        path = step_path(self.paths, step)
        key = _stat_key(path)
        if key == (0, 0):
            raise FileNotFoundError(f"{self._relative(path)}: no such file")
        with self._lock:
            cached = self._steps.get(step)
            if cached is not None and cached[0] == key:
                self._steps.move_to_end(step)
                return cached[1]
        table = self._read_table(path, None)
        warnings: list[str] = []
        body = {
            "step": step,
            "file": self._relative(path),
            "rows": step_rows(table, self._relative(path), warnings),
            "warnings": warnings,
        }
        encoded = _encode(body)
        with self._lock:
            self._steps[step] = (key, encoded)
            while len(self._steps) > STEP_CACHE_SIZE:
                self._steps.popitem(last=False)
        return encoded

    def search(self, query: str, flags: set[str], limit: int = 200) -> bytes:
        """Rows of every step whose text contains `query` (case-insensitive) and that have
        all of `flags` (zero: reward 0, errors, truncated, stale: staleness > 0)."""
        unknown = flags - set(FLAGS)
        if unknown:
            raise ValueError(f"unknown filter(s) {sorted(unknown)}: use {', '.join(FLAGS)}")
        hits: list[dict] = []
        errors: list[str] = []
        scanned = 0
        # The columns the match needs first; the rest only for a file with a match.
        needed = sorted({FLAG_COLUMNS[f] for f in flags} | ({"text"} if query else set()))
        for step in self.steps():
            if len(hits) >= limit:
                break
            path = step_path(self.paths, step)
            try:
                table = self._read_table(path, needed or ["reward"])
                scanned += 1
                keep = _flag_mask(table, flags)
                if query:
                    found = pc.match_substring(table["text"], query, ignore_case=True)
                    keep = found if keep is None else pc.and_(keep, found)
                keep = (
                    pa.array([True] * table.num_rows) if keep is None else pc.fill_null(keep, False)
                )
                if not pc.any(keep).as_py():
                    continue
                table = self._read_table(path, [*SEARCH_COLUMNS, "text"])
            except TrajectoryFileError as e:
                errors.append(str(e))
                continue
            table = table.append_column("index", pa.array(range(table.num_rows), pa.int64()))
            for row in table.filter(keep).slice(0, limit - len(hits)).to_pylist():
                row["snippet"] = _snippet(row.pop("text") or "", query)
                row["step"] = step
                hits.append(row)
        body = {
            "query": query,
            "flags": sorted(flags),
            "hits": hits,
            "limited": len(hits) >= limit,
            "scanned_steps": scanned,
            "errors": errors,
        }
        return _encode(body)

    def _read_config(self, errors: list[str]) -> tuple[dict | None, str | None]:
        path = self.paths.config
        if not path.exists():
            return None, None
        text = self._cached(path, lambda p: p.read_text(), errors)
        if text is None:
            return None, None
        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError as e:
            errors.append(f"{self._relative(path)}: not valid YAML ({_one_line(e)})")
            return None, text
        if not isinstance(config, dict):
            errors.append(
                f"{self._relative(path)}: expected a mapping of sections, got {text!r:.80}"
            )
            return None, text
        return _json_safe(config), text

    def _cached(self, path: Path, load: Callable[[Path], Any], errors: list[str]) -> Any:
        """`load(path)`, again only when the file changed; a failure goes into `errors`."""
        key = _stat_key(path)
        cached = self._files.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        if key == (0, 0) and not path.exists():
            return None
        try:
            value = load(path)
        except (OSError, UnicodeDecodeError, TrajectoryFileError) as e:
            errors.append(f"{self._relative(path)}: {_one_line(e)}")
            return None
        self._files[path] = (key, value)
        return value

    def _read_table(self, path: Path, columns: list[str] | None) -> pa.Table:
        """`columns` of a step file (None: all of SCHEMA's), checked to be there."""
        try:
            # ParquetFile.read: a third less time than read_table on small files.
            parquet = pq.ParquetFile(path)
            missing = [c for c in columns or SCHEMA.names if c not in parquet.schema_arrow.names]
            if missing:
                raise TrajectoryFileError(
                    f"{self._relative(path)}: not a looprl trajectory file (no column "
                    f"{', '.join(missing)})"
                )
            return parquet.read(columns=columns, use_threads=False)
        except (OSError, pa.ArrowException) as e:
            raise TrajectoryFileError(
                f"{self._relative(path)}: not a readable Parquet file ({_one_line(e)})"
            ) from None

    def _relative(self, path: Path) -> str:
        return str(path.relative_to(self.run_dir))


def read_metrics(path: Path) -> dict:
    """metrics.jsonl as columns: {"train": {key: [values]}, "eval": {...}}, numbers only,
    the warnings the run logged (records of kind "warning": {"step", "name", "message"},
    e.g. diagnostics/learning.py's, for the page's banner) and the errors met (a line
    that is not a JSON object names its number)."""
    records: dict[str, list[dict]] = {"train": [], "eval": []}
    warnings: list[dict] = []
    errors: list[str] = []
    with path.open("rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    if lines and lines[-1]:  # a record being appended
        lines = lines[:-1]
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            errors.append(f"{path.name} line {number}: not JSON ({e}); the line is skipped")
            continue
        if isinstance(record, dict) and record.get("kind") == "warning":
            warnings.append({k: record.get(k) for k in ("step", "name", "message")})
            continue
        if not isinstance(record, dict) or record.get("kind") not in records:
            errors.append(
                f"{path.name} line {number}: expected an object with kind 'train', 'eval' or "
                "'warning'; the line is skipped"
            )
            continue
        records[record["kind"]].append(record)
    columns = {kind: _columns(rows) for kind, rows in records.items()}
    return {"columns": columns, "warnings": warnings, "errors": errors}


def _columns(rows: list[dict]) -> dict[str, list]:
    keys: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if _is_number(value) or value is None:
                keys.setdefault(key)
    columns = {}
    for key in keys:
        values = [row.get(key) for row in rows]
        if any(_is_number(v) for v in values):
            columns[key] = [v if _is_number(v) else None for v in values]
    return columns


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and (isinstance(value, int) or math.isfinite(value))
    )


def step_rows(table: pa.Table, name: str, warnings: list[str]) -> list[dict]:
    """The rows of a step table as dicts; the JSON columns parsed (one that is not JSON
    stays a string and adds a warning naming `name`, the row and the column)."""
    rows = table.select([*ROW_COLUMNS, *TOKEN_COLUMNS, *JSON_COLUMNS]).to_pylist()
    for index, row in enumerate(rows):
        row["index"] = index
        mask = row["loss_mask"]
        for column in ("engine_logprobs", "trainer_logprobs"):  # None off the mask
            if row[column] is not None:
                row[column] = [
                    _round(v) if m else None for v, m in zip(row[column], mask, strict=False)
                ]
        row["loss_mask"] = [int(m) for m in mask]
        for column in JSON_COLUMNS:
            try:
                row[column] = json.loads(row[column]) if row[column] else None
            except ValueError as e:
                warnings.append(f"{name} row {index}: {column} is not JSON ({e})")
        lengths = {len(row[c]) for c in TOKEN_COLUMNS if row[c] is not None}
        if len(lengths) > 1:
            warnings.append(
                f"{name} row {index}: token columns differ in length "
                f"({', '.join(f'{c} {len(row[c])}' for c in TOKEN_COLUMNS if row[c] is not None)})"
            )
    return rows


def _flag_mask(table: pa.Table, flags: set[str]) -> pa.ChunkedArray | None:
    masks = []
    if "zero" in flags:
        masks.append(pc.equal(table["reward"], 0.0))
    if "errors" in flags:
        masks.append(pc.is_valid(table["error"]))
    if "truncated" in flags:
        masks.append(table["truncated"])
    if "stale" in flags:
        masks.append(pc.greater(table["staleness"], 0))
    if not masks:
        return None
    mask = masks[0]
    for m in masks[1:]:
        mask = pc.and_(mask, m)
    return mask


def _snippet(text: str, query: str, width: int = 60) -> str:
    at = text.lower().find(query.lower()) if query else 0
    at = max(at, 0)
    start = max(at - width, 0)
    return ("…" if start else "") + text[start : at + len(query) + width] + "…"


def _round(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(value, 4)


def _total_steps(config: dict | None) -> int | None:
    train = (config or {}).get("train")
    return train.get("total_steps") if isinstance(train, dict) else None


def _stat_key(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError:
        return (0, 0)
    return (st.st_mtime_ns, st.st_size)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _json_safe(value: Any) -> Any:
    """YAML's values as JSON has them: .inf and .nan as strings, dates and the like by str."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _encode(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
