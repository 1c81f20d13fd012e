"""What the code reward's box costs per test (`reward.type=code`).

Claim measured: a script test runs in two bubblewrap boxes (the program's, then the
judge's; each a new root file system, PID, network, IPC and UTS namespaces, a seccomp
filter, the memory watch, and as root a user id claimed per box), which adds a few tens
of milliseconds to a test, small against a model's sampling of the program. The
baseline, measured in the same run, is the same test through `CodeReward.score` with
`reward.code.isolation=unisolated` (the same harness and verdict, no box), and a bare
`python -I -S -c pass` (what any subprocess-per-test judge pays).

    .venv/bin/python bench/sandbox.py                # 40 tests each way (needs bubblewrap)
    .venv/bin/python bench/sandbox.py --as-test-user # as root: the same, run as an
                                                     # unprivileged user (a user namespace)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from looprl.config import CodeRewardConfig
from looprl.rewards.code import CodeReward

PROGRAM = "def f(x):\n    return 2 * x\n"
ROW = {"tests": ["assert f(2) == 4\nassert f(5) == 10"]}


async def per_test(isolation: str, repeats: int, concurrent: int) -> tuple[float, float]:
    """(median seconds of one test alone, seconds per test with `concurrent` at once)."""
    reward = CodeReward(CodeRewardConfig(isolation=isolation, max_concurrent=concurrent))
    assert await reward.score(PROGRAM, ROW) == 1.0  # warm
    alone = []
    for _ in range(repeats):
        start = time.perf_counter()
        assert await reward.score(PROGRAM, ROW) == 1.0
        alone.append(time.perf_counter() - start)
    start = time.perf_counter()
    scores = await asyncio.gather(*(reward.score(PROGRAM, ROW) for _ in range(repeats)))
    assert scores == [1.0] * repeats
    return statistics.median(alone), (time.perf_counter() - start) / repeats


def bare_python(repeats: int) -> float:
    python = os.path.realpath(sys.executable)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([python, "-I", "-S", "-c", "pass"], check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--concurrent", type=int, default=2, help="reward.code.max_concurrent")
    parser.add_argument(
        "--as-test-user",
        action="store_true",
        help="as root: run this as the unprivileged user the tests create "
        "(tests/support/as_user.py), whose boxes are user namespaces",
    )
    args = parser.parse_args()
    if args.as_test_user:
        repo = Path(__file__).resolve().parent.parent
        sys.path.insert(0, str(repo))
        from tests.support.as_user import run_as_user

        argv = [sys.executable, "bench/sandbox.py", f"--repeats={args.repeats}",
                f"--concurrent={args.concurrent}"]  # fmt: skip
        env = {"PATH": os.environ["PATH"], "HOME": "/tmp", "PYTHONPATH": str(repo)}
        done = run_as_user(argv, cwd=repo, env={**env, "PYTHONDONTWRITEBYTECODE": "1"}, timeout=600)
        print(done.stdout, done.stderr[-2000:] if done.returncode else "", end="")
        sys.exit(done.returncode)
    who = "root" if os.geteuid() == 0 else "a normal user"
    print(f"as {who}, {os.cpu_count()} cores, {args.repeats} tests each way")
    bare = bare_python(args.repeats)
    box_alone, box_many = asyncio.run(per_test("bubblewrap", args.repeats, args.concurrent))
    none_alone, none_many = asyncio.run(per_test("unisolated", args.repeats, args.concurrent))
    print(f"bare `python -I -S -c pass`:   {bare * 1e3:6.1f} ms")
    print(f"unisolated, one test:          {none_alone * 1e3:6.1f} ms")
    print(f"bubblewrap box, one test:      {box_alone * 1e3:6.1f} ms")
    print(f"  box / unisolated:            {box_alone / none_alone:6.2f}x")
    print(f"  box - unisolated:            {(box_alone - none_alone) * 1e3:6.1f} ms per test")
    print(f"{args.concurrent} at once, per test: box {box_many * 1e3:.1f} ms, "
          f"unisolated {none_many * 1e3:.1f} ms ({box_many / none_many:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
