"""The default training job, run exactly as `make demo` runs it: held-out accuracy before
and after training, and its wall time.

`looprl train recover.mode=off` with the default config (SmolLM2-135M-Instruct,
single-digit `+`/`*`, GRPO, 12 steps of 8 prompts x 8 samples), its run folder in a
temporary directory that is removed afterwards. Reported: the held-out accuracy at step
0 and after the last step (greedy, from the run's metrics.jsonl), the wall time the run
prints (TrainSummary: from the start of training to the saved model), and the whole
command's (process start to exit, imports included: what `make demo` takes). No
baseline: the earlier runs of the same job in BENCHMARKS.md are its comparison.

    .venv/bin/python bench/default_job.py [--json PATH]
    .venv/bin/python bench/default_job.py -- train.total_steps=1 eval.size=4   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Row, write_result

# "(best N% at step S, saved to ...)" follows the accuracies where the run kept its best
SUMMARY = re.compile(
    r"held-out accuracy: [\d.]+% -> [\d.]+%(?: \([^;]*?\))? in ([\d.]+) min \((\d+) steps\)"
)
START_UP = re.compile(r"Start-up: (.*)")


def run_default_job(overrides: list[str], root: Path) -> tuple[str, float]:
    """`looprl train recover.mode=off` with its runs under `root` and `overrides`, its
    output shown as it comes; (that output, the command's wall seconds)."""
    looprl = Path(sys.executable).with_name("looprl")  # this venv's
    command = [str(looprl), "train", "recover.mode=off", f"run.fileroot={root}", *overrides]
    print("$ " + " ".join(command), flush=True)
    lines = []
    start = time.monotonic()
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    seconds = time.monotonic() - start
    if proc.returncode:
        sys.exit(f"looprl train failed with exit status {proc.returncode} (its output above)")
    return "".join(lines), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="also write the rows here (bench/common.py)"
    )
    parser.add_argument(
        "overrides", nargs="*", help="dotted config overrides for `looprl train` (after --)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="default_job_") as root:
        output, seconds = run_default_job(args.overrides, Path(root))
        (metrics,) = Path(root).rglob("metrics.jsonl")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        (log,) = Path(root).rglob("train.log")
        start_up = START_UP.search(log.read_text())
    found = SUMMARY.search(output)
    if found is None:
        sys.exit("looprl train printed no summary line ('held-out accuracy: ... in N min')")
    printed_min, steps = float(found[1]), int(found[2])
    evals = [{"step": r["step"], "accuracy": r["accuracy"]} for r in records if r["kind"] == "eval"]
    trains = [r for r in records if r["kind"] == "train"]
    before, after = 100 * evals[0]["accuracy"], 100 * evals[-1]["accuracy"]
    command_min = seconds / 60
    print("\n| held-out accuracy before | after | wall time (printed) | command | steps |")
    print("|---:|---:|---:|---:|---:|")
    cells = [f"{before:.1f}%", f"{after:.1f}%", f"{printed_min:.1f} min", f"{command_min:.1f} min"]
    print(f"| {' | '.join(cells)} | {steps} |")
    if args.json is None:
        return
    rows = [  # no baseline: the earlier runs of the job in BENCHMARKS.md are its comparison
        Row(
            figure=figure,
            looprl=value,
            baseline=None,
            baseline_name="none",
            unit=unit,
            better=better,
            note=note,
        )
        for figure, value, unit, better, note in [
            (
                "`make demo`'s job: held-out accuracy before training",
                before,
                "%",
                "higher",
                "greedy",
            ),
            (f"held-out accuracy after {steps} steps", after, "%", "higher", f"from {before:.1f}%"),
            (
                "wall time the run prints",
                printed_min,
                "min",
                "lower",
                "start of training to the saved model",
            ),
            ("the whole command's wall time", command_min, "min", "lower", "process start to exit"),
        ]
    ]
    details = {
        "overrides": args.overrides,
        "start_up": start_up[1] if start_up else None,
        "evals": evals,
        "step_time_s": [r["step_time_s"] for r in trains],
        "train_time_s": [r["train_time_s"] for r in trains],
        "reward_mean": [r["reward_mean"] for r in trains],
    }
    write_result(args.json, "default_job", rows, details)


if __name__ == "__main__":
    main()
