"""The code test's split (what runs in the program's box, what runs in the judge box),
the refusals, and the checks on the records both boxes send back, written by hand: the
ones an honest run sends, and the ones a hostile program could forge."""

from __future__ import annotations

import json

import pytest

from looprl.rewards import code
from looprl.rewards.cases import ScriptTest, StdioTest, UnjudgeableTest, parse_test
from looprl.rewards.verdict import judge_stdio, judge_verdicts, program_values


def split(text: str) -> tuple[str, str]:
    test = parse_test(text)
    assert isinstance(test, ScriptTest)
    return test.program_script, test.judge_script


def value(v):
    return {"value": v}


def records(*sites, done=True):
    """The program box's records of an honest run: one per site (its leaves), then done."""
    out = [{"site": i, "values": list(values)} for i, values in enumerate(sites)]
    return out + ([{"done": True}] if done else [])


def verdicts(*passed, done=True):
    out = [{"site": i, "passed": p, "why": "" if p else "is false"} for i, p in enumerate(passed)]
    return out + ([{"done": True}] if done else [])


def test_the_expected_side_and_the_setup_stay_in_the_judge():
    program, judge = split(
        "import math\nexpected = 918273\nx = 3\nassert f(x) == expected, 'msg'\n"
        "assert math.isclose(g(1.0), math.exp(1.0))"
    )
    assert program == (
        "x = 3\n__looprl_emit__(0, lambda: f(x))\n__looprl_emit__(1, lambda: g(1.0))"
    )
    assert judge == (
        "import math\nexpected = 918273\nx = 3\n"
        "__looprl_verdict__(0, lambda: __looprl_value__(0, 0) == expected)\n"
        "__looprl_verdict__(1, lambda: math.isclose(__looprl_value__(1, 0), math.exp(1.0)))"
    )


def test_test_helpers_and_comprehensions_over_a_leaf_run_in_the_judge():
    program, judge = split(
        "def is_sorted(xs):\n    return all(a <= b for a, b in zip(xs, xs[1:]))\n"
        "assert is_sorted(my_sort([3, 1, 2]))\n"
        "assert all(x > 0 for x in f(3)) and type(f(2)) == int\n"
        "assert sorted(h(), key=lambda s: -len(s)) == ['bb', 'a']"
    )
    assert program == (
        "__looprl_emit__(0, lambda: my_sort([3, 1, 2]))\n"
        "__looprl_emit__(1, lambda: f(3), lambda: f(2))\n"
        "__looprl_emit__(2, lambda: h())"
    )
    assert judge.endswith(
        "__looprl_verdict__(0, lambda: is_sorted(__looprl_value__(0, 0)))\n"
        "__looprl_verdict__(1, lambda: all((x > 0 for x in __looprl_value__(1, 0))) and "
        "type(__looprl_value__(1, 1)) == int)\n"
        "__looprl_verdict__(2, lambda: sorted(__looprl_value__(2, 0), key=lambda s: -len(s)) "
        "== ['bb', 'a'])"
    )


def test_names_passed_to_the_program_are_read_back_from_its_box():
    program, judge = split(
        "a = [3, 1, 2]\nunused, b = [9], [1]\nsort_in_place(a)\nassert a == [1, 2, 3]\n"
        "xs = [1, 2, 3]\nassert total(xs) == 6\nassert xs == [1, 2, 3]\n"
        "s = Stack()\nassert s.pop() is None\nassert len(a) == 3"
    )
    assert program == (
        "a = [3, 1, 2]\nsort_in_place(a)\n__looprl_emit__(0, lambda: a)\n"
        "xs = [1, 2, 3]\n__looprl_emit__(1, lambda: total(xs))\n__looprl_emit__(2, lambda: xs)\n"
        "s = Stack()\n__looprl_emit__(3, lambda: s.pop())\n__looprl_emit__(4, lambda: a)"
    )
    # The judge runs the test's own statements; those with the program are the box's.
    assert judge == (
        "a = [3, 1, 2]\nunused = [9]\nb = [1]\n"
        "__looprl_verdict__(0, lambda: __looprl_value__(0, 0) == [1, 2, 3])\n"
        "xs = [1, 2, 3]\n__looprl_verdict__(1, lambda: __looprl_value__(1, 0) == 6)\n"
        "__looprl_verdict__(2, lambda: __looprl_value__(2, 0) == [1, 2, 3])\n"
        "__looprl_verdict__(3, lambda: __looprl_value__(3, 0) is None)\n"
        "__looprl_verdict__(4, lambda: len(__looprl_value__(4, 0)) == 3)"
    )


def test_stdlib_modules_used_unbound_are_imported_and_setup_calls_kept():
    program, judge = split(
        "import sys\nsys.setrecursionlimit(5000)\nassert f(math.pi) > 3\n"
        "assert math.isclose(f(1), 2)"
    )
    assert program == (
        "import math\nimport sys\nsys.setrecursionlimit(5000)\n"
        "__looprl_emit__(0, lambda: f(math.pi))\n__looprl_emit__(1, lambda: f(1))"
    )
    assert judge.startswith("import math\nimport sys\nsys.setrecursionlimit(5000)\n")


def test_humaneval_check_is_unrolled():
    program, judge = split(
        "METADATA = {}\n\ndef check(candidate):\n    want = [1]\n    assert True, 'debug'\n"
        "    assert candidate(2) == want\n    assert candidate(0) == []\n\ncheck(double)\n"
    )
    assert program == (
        "__looprl_emit__(0, lambda: double(2))\n__looprl_emit__(1, lambda: double(0))"
    )
    assert judge == (
        "METADATA = {}\nwant = [1]\nassert True, 'debug'\n"
        "__looprl_verdict__(0, lambda: __looprl_value__(0, 0) == want)\n"
        "__looprl_verdict__(1, lambda: __looprl_value__(1, 0) == [])"
    )


REFUSED = {
    "for a in [1]:\n    assert f(a) == 2": ("line 2: `assert f(a) == 2` is inside a for statement"),
    "def t():\n    assert f(1) == 2\nt()": "line 2: `assert f(1) == 2` is inside a functiondef",
    "x = 3\nassert x == 3\nassert f(1) == 2": (
        "line 2: `assert x == 3` does not check anything the program computes"
    ),
    "assert f(1) == g(1)": "line 1: `assert f(1) == g(1)` compares values that all come from",
    "x = f(1)\nassert x == f(2)": "line 2: `assert x == f(2)` compares values that all come from",
    "assert all(f(x) > 0 for x in range(3))": (
        "line 1: `f(x)` calls the program with `x`, a variable of the comprehension"
    ),
    "assert sorted([2, 1], key=lambda y: f(y)) == [1, 2]": (
        "line 1: `f(y)` calls the program with `y`, a variable of the"
    ),
    "def ok(v):\n    return v == f(1)\nassert ok(f(2))": (
        "line 1: `def ok(v):` is the test's own function but uses `f`"
    ),
    "r = f(3) - 10\nassert r == 5": (
        "line 1: `r = f(3) - 10` computes with the program's values outside an assert"
    ),
    "a = [1]\nf(a)\nn = len(a)\nassert n == 1": (
        "line 3: `n = len(a)` computes with the program's values outside an assert"
    ),
    "if f(1):\n    x = 1\nassert f(2) == 1": "line 1: `if f(1):` uses the program inside control",
    "assert (y := f(1)) == 2": "line 1: `y := f(1)` binds a name with := ",
    "assert eval(f(1)) == 2": "line 1: `eval(f(1))` turns the program's data into code",
    "assert getattr(x, f(1)) == 2": "turns the program's data into code",
    "import pickle\nassert pickle.loads(f(1)) == 2": "turns the program's data into code",
    "f(1)": "no top-level assert on what the program computes",
    "assert True": "no top-level assert on what the program computes",
}


@pytest.mark.parametrize("test", REFUSED)
def test_what_cannot_be_judged_apart_is_refused_with_why(test):
    with pytest.raises(UnjudgeableTest) as refused:
        parse_test(test)
    assert REFUSED[test] in str(refused.value)


def test_a_malformed_test_is_not_parsed():
    with pytest.raises(ValueError, match="does not parse"):
        parse_test("assert (")


def test_the_program_box_records_must_be_every_site_in_order_then_done():
    test = parse_test("assert f(2) == 4\nassert f(5) == 10 and f(0) == 0")
    good = records([value(4)], [value(10), {"error": "ZeroDivisionError: x"}])
    data, why = program_values(test, good)
    assert why == "" and json.loads(data) == [[value(4)], [value(10), good[1]["values"][1]]]
    forged = {
        "no done": good[:-1],
        "a site twice": [good[0], good[0], good[1], good[2]],
        "a site missing": [good[0], good[2]],
        "out of order": [good[1], good[0], good[2]],
        "a record after done": [*good, good[0]],
        "a bool site": [{"site": True, "values": [value(4)]}, good[1], good[2]],
        "too many values": [{"site": 0, "values": [value(4), value(4)]}, good[1], good[2]],
        "an extra key": [{**good[0], "passed": True}, good[1], good[2]],
        "a value neither value, error nor opaque": [
            {"site": 0, "values": [{"passed": True}]},
            good[1],
            good[2],
        ],
        "an error that is not text": [{"site": 0, "values": [{"error": 1}]}, good[1], good[2]],
        "the judge's records": verdicts(True, True),
        "nothing": [],
    }
    for name, forgery in forged.items():
        assert program_values(test, forgery)[0] is None, name
    assert program_values(test, good[:1]) == (
        None,
        "line 2: `assert f(5) == 10 and f(0) == 0` was never reached",
    )


def test_a_value_too_deep_to_forward_fails_the_run():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    test = parse_test("assert f(1) == [1]")
    assert program_values(test, records([value(deep)])) == (
        None,
        "the program's values are nested too deeply to forward",
    )


def test_the_judge_records_must_be_every_verdict_passed_then_done():
    test = parse_test("assert f(2) == 4\nassert f(5) == 10")
    assert judge_verdicts(test, verdicts(True, True)) == (True, "")
    assert judge_verdicts(test, verdicts(True, False)) == (
        False,
        "line 2: `assert f(5) == 10` is false",
    )
    forged = {
        "no done": verdicts(True, True, done=False),
        "a verdict missing": verdicts(True),
        "out of order": [verdicts(True, True)[1], verdicts(True, True)[0], {"done": True}],
        "a truthy non-bool": [{"site": 0, "passed": 1, "why": ""}, *verdicts(True, True)[1:]],
        "more after done": [*verdicts(True, True), {"done": True}],
        "nothing": [],
    }
    for name, forgery in forged.items():
        assert judge_verdicts(test, forgery)[0] is False, name


def test_stdio_cases_compare_lines_and_need_exit_0():
    case = parse_test({"input": "3\n", "output": "6\n7"})
    assert case == StdioTest("3\n", "6\n7")
    assert judge_stdio(case, "6  \n7\n\n", 0) == (True, "")
    assert judge_stdio(case, "6\n8\n", 0)[0] is False
    assert judge_stdio(case, "6\n7\n", 1) == (False, "the program exited with status 1")
    with pytest.raises(ValueError, match="input"):
        parse_test({"input": "3"})


def test_row_fields_name_the_field_and_the_test():
    assert len(code.tests_of({"tests": "assert f() == 1"}, "tests")) == 1
    with pytest.raises(KeyError, match="reward.code.tests_field"):
        code.tests_of({"q": 1}, "tests")
    with pytest.raises(ValueError, match="row field 'tests', test 1: .*inside a for"):
        code.tests_of({"tests": ["assert f() == 1", "for i in []:\n    assert f()"]}, "tests")
