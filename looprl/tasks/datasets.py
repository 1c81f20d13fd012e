"""Reading dataset rows from JSONL or Parquet files, or a Hugging Face dataset.

A row that cannot be used (bad JSON, not an object, missing the prompt or answer
field) is skipped with a warning naming the file and line, and counted; a file with no
usable row is an error.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from looprl.config import TaskConfig

log = logging.getLogger(__name__)


def load_rows(path: str, kind: str, cfg: TaskConfig, field: str = "task.train_path") -> list[dict]:
    """The usable rows of the file (or HF dataset) at `path`, which the config's `field`
    names (for the errors)."""
    required = (cfg.prompt_field, cfg.answer_field)
    if kind == "hf":
        rows = _read_hf(path)
    else:
        file = Path(path).expanduser()
        if not file.is_file():
            raise FileNotFoundError(
                f"{field}={path}: {file.absolute()} does not exist; give the file's path, "
                "absolute or relative to the folder looprl runs in"
            )
        rows = _read_jsonl(file) if kind == "jsonl" else _read_parquet(file)
    good, skipped, first = [], 0, ""
    for where, row in rows:
        problem = _check(row, required)
        if problem:
            skipped += 1
            first = first or f"{where}: {problem}"
            if skipped <= 5:
                log.warning("Skipping row %s: %s", where, problem)
            continue
        good.append(row)
    if skipped:
        log.warning(
            "Skipped %d of %d rows of %s (first 5 shown above)", skipped, skipped + len(good), path
        )
    if not good:
        found = f"; of {skipped} rows, the first: {first}" if skipped else " (it is empty)"
        raise ValueError(
            f"{field}={path} has no usable row with fields {list(required)}{found}; set "
            "task.prompt_field and task.answer_field to your rows' fields, or fix the rows"
        )
    return good


def _check(row, required: tuple[str, ...]) -> str | None:
    if isinstance(row, str):  # a parse error message
        return row
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    missing = [f for f in required if row.get(f) in (None, "")]
    return f"missing field(s) {missing} (has {sorted(row)})" if missing else None


def _read_jsonl(file: Path):
    with file.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{file}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{file}:{lineno}", f"invalid JSON ({e.msg})"


def _read_parquet(file: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("reading Parquet needs pyarrow: pip install pyarrow") from e
    for i, row in enumerate(pq.read_table(file).to_pylist()):
        yield f"{file} row {i}", row


def _read_hf(name: str):
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "task.name='hf' needs the `datasets` package: pip install datasets"
        ) from e
    split = "train"
    if ":" in name:
        name, split = name.split(":", 1)
    data = (
        datasets.load_from_disk(name)
        if Path(name).is_dir()
        else datasets.load_dataset(name, split=split)
    )
    if isinstance(data, datasets.DatasetDict):
        data = data[split]
    for i, row in enumerate(data):
        yield f"{name}[{split}] row {i}", dict(row)
