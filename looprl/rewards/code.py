"""reward.type=code: the fraction of the row's tests the model's program passes.

The program is the last ```python (or plain ```) fenced block of the completion, else
the whole completion. The tests are the row's `reward.code.tests_field`: a list of
snippets (e.g. `assert f(2) == 4`), each run after the program in its own sandbox, or
one test script. A sandbox that could not run (not the program failing) rejects the
rollout and is counted as `reward_code_sandbox_errors`: the model is not punished for
the machine.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections import Counter
from collections.abc import AsyncIterator

from looprl.config import CodeRewardConfig
from looprl.rewards import Scorer
from looprl.rewards.sandbox import Sandbox

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


def tests_of(row: dict, field: str) -> list[str]:
    """The row's tests as a list of snippets (one test script is a list of one)."""
    if field not in row:
        raise KeyError(
            f"dataset row has no field {field!r} (fields: {sorted(row)}); set "
            "reward.code.tests_field"
        )
    tests = row[field]
    if isinstance(tests, str):
        tests = [tests]
    if not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(
            f"row field {field!r} must be a test script or a non-empty list of test "
            f"snippets (strings), got {tests!r:.200}"
        )
    return list(tests)


class CodeReward:
    def __init__(self, cfg: CodeRewardConfig):
        self.cfg = cfg
        self.sandbox = Sandbox(cfg)
        self._counts: Counter[str] = Counter()
        self._warned = False

    @contextlib.asynccontextmanager
    async def rollout(self, row: dict) -> AsyncIterator[Scorer]:
        async def score(prompt: str, completion: str) -> float | None:
            return await self.score(completion, row)

        yield score

    async def aclose(self) -> None:
        pass

    async def score(self, completion: str, row: dict) -> float | None:
        """Tests passed / tests, or None when the sandbox itself failed."""
        tests = tests_of(row, self.cfg.tests_field)
        program = extract_program(completion)
        passed = 0
        for test in tests:
            run = await self.sandbox.run(program, test)
            self._counts["reward_code_tests"] += 1
            if run.status == "sandbox_error":
                self._counts["reward_code_sandbox_errors"] += 1
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "The code sandbox failed to run a test (%s); the rollout is "
                        "rejected, later failures are counted as reward_code_sandbox_errors",
                        run.output.strip()[-300:],
                    )
                return None
            self._counts["reward_code_timeouts"] += run.status == "timed_out"
            passed += run.status == "passed"
        self._counts["reward_code_tests_passed"] += passed
        return passed / len(tests)

    def take_stats(self) -> dict[str, int]:
        names = ["reward_code_tests", "reward_code_tests_passed", "reward_code_timeouts"]
        stats = {name: self._counts[name] for name in [*names, "reward_code_sandbox_errors"]}
        self._counts.clear()
        return stats

    def __repr__(self) -> str:
        return (
            f"code reward (tests in row field {self.cfg.tests_field!r}, {self.sandbox.isolation})"
        )
