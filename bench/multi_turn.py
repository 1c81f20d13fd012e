"""Multi-turn learning against one turn: each agent of examples/multi_turn.py whose first
replies are long and unrewarded, trained on a task the model starts at 5-30% held out,
beside its one-turn twin (`OneTurn`: the same question and "Reply with only the final
number." at once) on the same rows with the same settings: does the multi-turn agent
gain as many held-out points over the default 12 steps?

    .venv/bin/python bench/multi_turn.py                      # every case, both agents
    .venv/bin/python bench/multi_turn.py --cases chain2_work --no-twins -- train.lr=4e-5
    .venv/bin/python bench/multi_turn.py --summarize DIR      # re-read finished runs

Each run is `looprl train` with the case's task, its agent and the overrides after `--`,
its held-out split cut to 50 rows (eval every 4 steps, greedy), two runs at a time with
one thread each (`--parallel`). Printed per run: held-out success at each evaluation,
its best, the gain (last - first) and the best's gain; the sampled train reward over the
first and last 3 steps; the share of model calls cut at the token limit (first and last
step); the share of groups with equal rewards; and the share of the policy loss's weight
(|advantage| x tokens) on the last reply (`last_call_loss_share`). The baseline of each
multi-turn row is its one-turn twin measured in the same invocation: the ratio is the
multi-turn gain over the twin's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELD_OUT = 50


def _rg(dataset: str, **kwargs: int) -> list[str]:
    args = ", ".join(f"{k}: {v}" for k, v in kwargs.items())
    return ["task.name=reasoning_gym", f"task.dataset={dataset}", f"task.dataset_kwargs={{{args}}}"]


# case -> (the task's overrides, the multi-turn agent). Greedy held-out success at step 0
# on SmolLM2-135M-Instruct, 50 rows, multi-turn / one-turn twin: chain2_work 24% /
# 12-16%, basic_plan 4-8% / 16-20%, chain3_work 12-16% / 14%, seq_check 8% / 20-22% (two
# evaluations of one policy can differ by a row or two: the batch's composition changes
# float rounding).
CASES = {
    # "15 - 4 + 7 =" answered freely, then "Reply with only the final number."
    "chain2_work": (
        _rg("chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=2),
        "WorkThenNumber",
    ),
    # "Calculate 6 * 3 - 4." planned without solving, then the number alone
    "basic_plan": (
        _rg("basic_arithmetic", min_terms=2, max_terms=2, min_digits=1, max_digits=1),
        "PlanThenNumber",
    ),
    # "8 - 6 + 7 =" (three one-digit terms) answered freely, then the number alone
    "chain3_work": (
        _rg("chain_sum", min_terms=3, max_terms=3, min_digits=1, max_digits=1),
        "WorkThenNumber",
    ),
    # "3, 6, 12, 24, ?" answered, checked step by step, then the number alone (3 turns)
    "seq_check": (["task.name=reasoning_gym", "task.dataset=number_sequence"], "AnswerCheckNumber"),
}


def run(name: str, task: list[str], agent: str, overrides: list[str], root: Path, threads: int):
    """`looprl train` of one agent on one case; its output in root/<name>.log."""
    looprl = Path(sys.executable).with_name("looprl")
    command = [
        str(looprl),
        "train",
        "recover.mode=off",
        f"run.fileroot={root}",
        f"run.experiment_name={name}",
        f"workflow.path=examples.multi_turn:{agent}",
        f"task.eval_size={HELD_OUT}",
        *task,
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.monotonic()
    with open(root / f"{name}.log", "w") as log:
        code = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    minutes = (time.monotonic() - start) / 60
    status = "ok" if code.returncode == 0 else f"FAILED (exit {code.returncode})"
    print(f"{name}: {status} in {minutes:.1f} min ({root / name}.log)", flush=True)


def summarize(run_dir: Path) -> dict | None:
    """The figures of one finished run from its metrics.jsonl (None: no such run)."""
    found = sorted(run_dir.glob("trial*/metrics.jsonl"))
    if not found:
        return None
    records = [json.loads(line) for line in found[-1].read_text().splitlines()]
    evals = {}
    for r in records:
        if r["kind"] == "eval":
            evals.setdefault(r["step"], 100 * r["accuracy"])  # the first at a step
    trains = [r for r in records if r["kind"] == "train"]
    if not trains or len(evals) < 2:
        return None
    steps = sorted(evals)
    held = [evals[s] for s in steps]

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else float("nan")

    return {
        "steps": steps,
        "held_out": held,
        "best": max(held),
        "gain": held[-1] - held[0],
        "best_gain": max(held) - held[0],
        "reward_first3": mean(r["reward_mean"] for r in trains[:3]),
        "reward_last3": mean(r["reward_mean"] for r in trains[-3:]),
        "cut_first": trains[0].get("truncated_call_share"),
        "cut_last": trains[-1].get("truncated_call_share"),
        "equal_groups": mean(r["degenerate_group_share"] for r in trains),
        "last_call_loss_share": mean(_last_turn(r, "loss_share") for r in trains),
        "first_tokens": (
            mean(r.get("turn1_tokens") for r in trains[:3]),
            mean(r.get("turn1_tokens") for r in trains[-3:]),
        ),
        "minutes": (trains[-1]["time"] - records[0]["time"]) / 60,
    }


def _last_turn(record: dict, name: str) -> float | None:
    """`turn{K}_<name>` of the record's last call position K (None: one call)."""
    turns = [int(m[1]) for key in record if (m := re.fullmatch(rf"turn(\d+)_{name}", key))]
    return record[f"turn{max(turns)}_{name}"] if turns else None


def table(root: Path, names: list[str]) -> None:
    print(
        "\n| run | held out at each eval | best | gain | best's gain | train reward, "
        "steps 1-3 -> last 3 | calls cut, first -> last step | equal groups | "
        "last reply's loss share | first reply's tokens | gain vs one-turn twin |"
    )
    print("|---|---|---:|---:|---:|---|---|---:|---:|---|---:|")
    rows = {name: summarize(root / name) for name in names}
    for name, s in rows.items():
        if s is None:
            print(f"| {name} | (no finished run) |")
            continue
        twin = rows.get(twin_name(name))
        ratio = ""
        if twin is not None and twin is not s:
            ratio = f"{s['gain']:+.0f} vs {twin['gain']:+.0f}"
        cut = f"{s['cut_first']:.0%} -> {s['cut_last']:.0%}" if s["cut_first"] is not None else ""
        share = s["last_call_loss_share"]
        cells = [
            name,
            " -> ".join(f"{v:.0f}%" for v in s["held_out"]),
            f"{s['best']:.0f}%",
            f"{s['gain']:+.0f}",
            f"{s['best_gain']:+.0f}",
            f"{s['reward_first3']:.2f} -> {s['reward_last3']:.2f}",
            cut,
            f"{s['equal_groups']:.0%}",
            "" if math.isnan(share) else f"{share:.2f}",
            ""
            if math.isnan(s["first_tokens"][0])
            else "{:.0f} -> {:.0f}".format(*s["first_tokens"]),
            ratio,
        ]
        print("| " + " | ".join(cells) + " |")


def twin_name(name: str) -> str:
    """The run name of `name`'s one-turn twin: chain2_work-lr4 -> chain2_one-lr4 (a twin's
    own name maps to itself)."""
    case, dash, label = name.partition("-")
    return f"{case.rsplit('_', 1)[0]}_one{dash}{label}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: %(default)s")
    parser.add_argument("--no-twins", action="store_true", help="skip the one-turn twins")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--label", default="", help="appended to each run's name")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=OVERRIDES",
        help="a set of space-separated overrides run as its own rows, named case-LABEL "
        "(repeatable; the overrides after -- apply to every variant)",
    )
    parser.add_argument("--root", type=Path, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--summarize", type=Path, metavar="DIR", help="only read DIR's runs")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (after --)")
    args = parser.parse_args()
    if args.summarize:
        names = sorted(p.name for p in args.summarize.iterdir() if p.is_dir())
        table(args.summarize, names)
        return
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; the cases are {', '.join(CASES)}")
    root = args.root or Path(tempfile.mkdtemp(prefix="multi_turn_"))
    root.mkdir(parents=True, exist_ok=True)
    variants = [(args.label, [])]
    if args.variant:
        variants = [v.split("=", 1) for v in args.variant]
        variants = [(label, overrides.split()) for label, overrides in variants]
    jobs = []
    for label, overrides in variants:
        suffix = f"-{label}" if label else ""
        for case in cases:
            task, agent = CASES[case]
            jobs.append((f"{case}{suffix}", task, agent, overrides + args.overrides))
            if not args.no_twins:
                twin = twin_name(f"{case}{suffix}")
                jobs.append((twin, task, "OneTurn", overrides + args.overrides))
    threads = max(1, (os.cpu_count() or 2) // args.parallel)
    print(f"{len(jobs)} runs, {args.parallel} at a time, in {root}", flush=True)
    with ThreadPoolExecutor(args.parallel) as pool:
        for job in jobs:
            pool.submit(run, *job, root, threads)
    table(root, [job[0] for job in jobs])


if __name__ == "__main__":
    main()
