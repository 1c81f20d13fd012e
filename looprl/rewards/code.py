"""reward.type=code: the fraction of the row's tests the model's program passes, judged
outside the program.

The program is the last ```python (or plain ```) fenced block of the completion, else
the whole completion. The tests are the row's `reward.code.tests_field`: a list of test
scripts or stdin/stdout cases (looprl/rewards/cases.py), each run with the program in a
box of its own (looprl/rewards/sandbox.py); a script's asserts are then judged in a
second box that runs the test alone on the values the program's box sent back. What
comes back is data: nothing is evaluated here. A program that crashes, exits early,
truncates its output, writes on looprl's results pipe or kills itself fails its test (0
for it). Only a box that
looprl could not start is a sandbox error: the rollout is rejected (the model is not
punished for the machine), the first one is logged, and `check_failures` stops the run
when a step's sandbox errors pass `reward.max_failure_rate`.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections import Counter
from collections.abc import AsyncIterator

from looprl.config import CodeRewardConfig
from looprl.rewards import Scorer, check_failure_rate
from looprl.rewards.cases import StdioTest, Test, parse_test
from looprl.rewards.sandbox import BoxRun, Sandbox
from looprl.rewards.verdict import judge_stdio, judge_verdicts, program_values

log = logging.getLogger(__name__)

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_program(completion: str) -> str:
    """The last fenced code block of `completion`, else all of it.

    >>> extract_program("Here:\\n```python\\ndef f(x):\\n    return 2 * x\\n```\\nDone.")
    'def f(x):\\n    return 2 * x\\n'
    >>> extract_program("def f(x): return x")
    'def f(x): return x'
    """
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def tests_of(row: dict, field: str) -> list[Test]:
    """The row's tests, each parsed (a test script alone is a list of one); raises
    ValueError naming the field and the test when one cannot be judged."""
    if field not in row:
        raise KeyError(
            f"dataset row has no field {field!r} (fields: {sorted(row)}); set "
            "reward.code.tests_field"
        )
    tests = row[field]
    if isinstance(tests, str | dict):
        tests = [tests]
    if not isinstance(tests, list) or not tests:
        raise ValueError(
            f"row field {field!r} must be a test script, a stdin/stdout case, or a non-empty "
            f"list of them, got {tests!r:.200}"
        )
    parsed = []
    for index, test in enumerate(tests):
        try:
            parsed.append(parse_test(test))
        except ValueError as e:
            raise ValueError(f"row field {field!r}, test {index}: {e}") from None
    return parsed


class CodeReward:
    def __init__(self, cfg: CodeRewardConfig):
        self.cfg = cfg
        self.sandbox = Sandbox(cfg)
        self._counts: Counter[str] = Counter()
        self._warned = False
        self._last_error = ""

    @contextlib.asynccontextmanager
    async def rollout(self, row: dict) -> AsyncIterator[Scorer]:
        async def score(prompt: str, completion: str) -> float | None:
            return await self.score(completion, row)

        yield score

    async def aclose(self) -> None:
        pass

    async def score(self, completion: str, row: dict) -> float | None:
        """Tests passed / tests, or None when a box could not be started."""
        tests = tests_of(row, self.cfg.tests_field)
        program = extract_program(completion)
        self._counts["reward_code_rollouts"] += 1
        passed = 0
        for test in tests:
            verdict = await self.run_test(program, test)
            self._counts["reward_code_tests"] += 1
            if verdict is None:
                self._counts["reward_code_sandbox_errors"] += 1
                return None
            passed += verdict
        self._counts["reward_code_tests_passed"] += passed
        return passed / len(tests)

    async def run_test(self, program: str, test: Test) -> bool | None:
        """Whether `program` passes `test`; None when a box could not start.

        A script takes two boxes: the program's, which computes the asserts' leaves, and
        then, if it ran to its end, the judge box, which runs the test alone on those
        values (looprl/rewards/cases.py)."""
        if isinstance(test, StdioTest):
            run = await self._box(program, None, test.input)
            if not isinstance(run, BoxRun):
                return run
            return judge_stdio(test, run.stdout, run.returncode)[0]
        run = await self._box(program, test.program_script)
        if not isinstance(run, BoxRun):
            return run
        values, _ = program_values(test, run.records)
        if values is None:
            return False
        judged = await self._box("", test.judge_script, data=values)
        if not isinstance(judged, BoxRun):
            return judged
        return judge_verdicts(test, judged.records)[0]

    async def _box(
        self, program: str, script: str | None, stdin: str = "", data: str | None = None
    ) -> BoxRun | bool | None:
        """The box's run; False when it timed out or went over a budget (the test
        fails), None when it could not start (a sandbox error)."""
        run = await self.sandbox.run(program, script, stdin, data)
        if not run.started:
            self._last_error = run.output.strip()[-300:]
            if not self._warned:
                self._warned = True
                log.warning(
                    "The code sandbox could not start a box (%r); the rollout is rejected, "
                    "later ones are counted as reward_code_sandbox_errors",
                    self._last_error,
                )
            return None
        self._counts["reward_code_timeouts"] += run.timed_out
        self._counts["reward_code_over_budget"] += run.killed_for is not None
        if run.timed_out or run.killed_for:
            return False
        return run

    def check_failures(self, max_rate: float, min_judgments: int) -> None:
        """RewardFailed when more than `max_rate` of the rollouts since the last
        `take_stats` (at least `min_judgments`) found no box to run in."""
        errors = self._counts["reward_code_sandbox_errors"]
        rollouts = self._counts["reward_code_rollouts"]
        check_failure_rate(
            errors,
            rollouts,
            max_rate,
            min_judgments,
            what=f"the code sandbox could not start a box for {errors} of {rollouts} rollouts",
            last_error=self._last_error,
        )

    def take_stats(self) -> dict[str, int]:
        names = ["rollouts", "tests", "tests_passed", "timeouts", "over_budget", "sandbox_errors"]
        stats = {f"reward_code_{n}": self._counts[f"reward_code_{n}"] for n in names}
        self._counts.clear()
        return stats

    def __repr__(self) -> str:
        return (
            f"code reward (tests in row field {self.cfg.tests_field!r}, {self.sandbox.describe()})"
        )
