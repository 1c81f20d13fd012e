"""What a bench script that is a part of `make bench` (bench/headline.py) writes with
`--json PATH`: its rows, each a figure of looprl's beside its baseline's, and the
machine, commit and date they were measured on.

The file, one JSON object:

    {"part": "engine", "command": "python bench/engine.py", "rows": [
        {"figure": "...", "looprl": 676.0, "baseline": 249.0, "baseline_name": "HF generate",
         "unit": "tok/s", "better": "higher", "ratio": 2.71, "note": "..."}, ...],
     "details": {...what else the script measured...},
     "date": "2026-11-28 14:05 UTC", "commit": "28289e7", "machine": {...machine()...}}

`ratio` is oriented so that > 1 means looprl is better: looprl / baseline where higher is
better (throughput, accuracy), baseline / looprl where lower is (times, memory, sizes);
null without a baseline. A bench script runs as `python bench/x.py`, so this folder is
first on its path: `from common import Row, write_result`.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import torch

from looprl.precision import cpu
from looprl.runtime import FORCE_CPU_VARIABLE, forced_cpu

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True, kw_only=True)
class Row:
    """One figure of a part: looprl's value beside its baseline's (None: no baseline).

    `better` says which way the figure improves, and so orients `ratio`: "higher"
    (tok/s, accuracy) gives looprl / baseline, "lower" (s, GiB, MiB) baseline / looprl.
    """

    figure: str  # what is measured, in plain words
    looprl: float
    baseline: float | None
    baseline_name: str  # e.g. "HF generate", "TRL 1.16.0 GRPOTrainer", "sync"; "none"
    unit: str  # tok/s, s, min, %, GiB, steps/h ...
    better: Literal["higher", "lower"]
    note: str = ""

    def __post_init__(self) -> None:
        if self.better not in ("higher", "lower"):
            raise ValueError(
                f"Row {self.figure!r}: better={self.better!r}; it is 'higher' (throughput, "
                "accuracy) or 'lower' (times, memory, sizes)"
            )

    @property
    def ratio(self) -> float | None:
        """> 1 when looprl is better; None without a baseline or with a zero to divide by."""
        if self.baseline is None:
            return None
        if self.better == "higher":
            return self.looprl / self.baseline if self.baseline else None
        return self.baseline / self.looprl if self.looprl else None

    def as_dict(self) -> dict:
        return {
            "figure": self.figure,
            "looprl": self.looprl,
            "baseline": self.baseline,
            "baseline_name": self.baseline_name,
            "unit": self.unit,
            "better": self.better,
            "ratio": self.ratio,
            "note": self.note,
        }


def write_result(
    path: Path | str, part: str, rows: list[Row], details: dict, command: str | None = None
) -> dict:
    """Write a part's result to `path` (the contract above) and return it. `command`
    defaults to this script's own command line (`script_command`)."""
    result = {
        "part": part,
        "command": command or script_command(),
        "rows": [row.as_dict() for row in rows],
        "details": details,
        "date": now(),
        "commit": git_commit(),
        "machine": machine(),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def script_command(argv: list[str] | None = None) -> str:
    """`argv` (default: this process's) as `python bench/x.py ARGS`, without `--json PATH`
    (where the result went is not how it was measured), after `LOOPRL_FORCE_CPU=avx2`
    when that is set."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    shown = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else argv[0]
    args, rest = [], iter(argv[1:])
    for arg in rest:
        if arg == "--json":
            next(rest, None)
        elif not arg.startswith("--json="):
            args.append(arg)
    forced = forced_cpu()
    prefix = f"{FORCE_CPU_VARIABLE}={forced} " if forced else ""
    return prefix + shlex.join(["python", shown, *args])


def cpu_label(kind: str, forced: str | None) -> str:
    """The CPU kind as BENCHMARKS.md names it: '[AVX-512 BF16]', '[AVX2]', or
    '[AVX2, forced]' under LOOPRL_FORCE_CPU=avx2 (whatever the CPU itself is)."""
    return f"[{forced.upper()}, forced]" if forced else f"[{kind}]"


def machine() -> dict:
    """This machine's CPU and torch, as a result records them."""
    found, forced = cpu(), forced_cpu()
    return {
        "label": cpu_label(found.kind, forced),
        "kind": found.kind,
        "model": found.model,
        "flags": found.isa,
        "cores": found.cores,
        "threads": torch.get_num_threads(),
        "forced_cpu": forced,
        "torch": torch.__version__,
    }


def git_commit() -> str:
    """HEAD's short sha, with '-dirty' when the checkout has changes outside
    bench/results/ (the results themselves do not change what is measured); 'unknown'
    outside a git checkout."""
    try:
        sha = _git("rev-parse", "--short", "HEAD")
        changed = _git("status", "--porcelain", "--", ".", f":(exclude){RESULTS.relative_to(ROOT)}")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if changed else "")


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
