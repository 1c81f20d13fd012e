"""The code test's split (what enters the box, what stays here) and the verdict on the
records a box sends back, with records written by hand: the ones an honest run sends,
and the ones a hostile program could forge."""

from __future__ import annotations

import pytest

from looprl.rewards import code
from looprl.rewards.cases import (
    ScriptTest,
    StdioTest,
    UnjudgeableTest,
    decode,
    judge_script,
    judge_stdio,
    parse_test,
)


def value(v):
    return {"value": v}


def records(*sites, done=True):
    """Records of an honest run: one per site (its leaf values), then done."""
    out = [{"site": i, "values": list(values)} for i, values in enumerate(sites)]
    return out + ([{"done": True}] if done else [])


def test_the_expected_value_never_enters_the_box():
    test = parse_test("import math\nx = 3\nassert f(x) == 6, 'doubles'\nassert f(2) > 3")
    assert isinstance(test, ScriptTest)
    assert "6" not in test.script and "3)" not in test.script.split("x = 3")[1]
    assert test.script == (
        "import math\nx = 3\n__looprl_emit__(0, lambda: f(x))\n__looprl_emit__(1, lambda: f(2))"
    )
    assert [s.leaves for s in test.sites] == [1, 1]
    assert judge_script(test, records([value(6)], [value(4)])) == (True, "")
    assert judge_script(test, records([value(6)], [value(3)])) == (
        False,
        "line 4: `assert f(2) > 3` is false",
    )


def test_builtins_and_known_names_are_evaluated_here():
    test = parse_test(
        "expected = [1, 2, 3]\n"
        "assert sorted(f([3, 1, 2])) == expected\n"
        "assert abs(g(2) - 1.5) < 1e-9\n"
        "assert math.isclose(g(2), 1.5)\n"
        "assert len(h()) == 2 and h()[0] == 'a'\n"
        "assert sorted(h(), key=len, reverse=True) == ['bb', 'a']\n"
    )
    assert [s.leaves for s in test.sites] == [1, 1, 1, 2, 1]
    honest = records(
        [value([3, 2, 1])], [value(1.5)], [value(1.5)], [value(["a", "bb"]), value("a")],
        [value(["a", "bb"])],
    )  # fmt: skip
    assert judge_script(test, honest) == (True, "")
    # g(2) = 1.6: abs(1.6 - 1.5) < 1e-9 is false here, whatever the box's objects did.
    wrong = records(
        [value([3, 2, 1])], [value(1.6)], [value(1.5)], [value(["a", "bb"]), value("a")],
        [value(["a", "bb"])],
    )  # fmt: skip
    assert judge_script(test, wrong) == (False, "line 3: `assert abs(g(2) - 1.5) < 1e-9` is false")


def test_a_name_rebound_by_the_program_side_is_no_longer_known():
    test = parse_test("y = 4\ny = f(2)\nassert y == 4")
    assert test.sites[0].leaves == 1  # y now comes from the box: compared with 4 here
    assert judge_script(test, records([value(4)]))[0]
    assert not judge_script(test, records([value(5)]))[0]


def test_tagged_values_decode_to_the_types_they_name():
    encoded = {"$dict": [[1, {"$tuple": [1, 2]}], ["s", {"$set": [1]}]]}
    assert decode(encoded) == {1: (1, 2), "s": {1}}
    assert decode({"$frozenset": [{"$bytes": "6869"}]}) == frozenset({b"hi"})
    test = parse_test("assert f() == (1, 2)")
    assert judge_script(test, records([value({"$tuple": [1, 2]})]))[0]
    assert not judge_script(test, records([value([1, 2])]))[0]  # a list is not a tuple
    for forged in ({"$eval": "1"}, {"$tuple": 3, "x": 1}, {"__eq__": True}):
        assert judge_script(test, records([value(forged)]))[0] is False


def test_records_out_of_place_fail():
    test = parse_test("assert f(2) == 4\nassert f(5) == 10")
    good = records([value(4)], [value(10)])
    assert judge_script(test, good)[0]
    forged = [
        ("no done", good[:-1]),
        ("a site twice", [good[0], good[0], good[1], good[2]]),
        ("a site missing", [good[0], good[2]]),
        ("a record after done", [*good, good[0]]),
        ("an unknown site", [*good[:2], {"site": 7, "values": [value(1)]}, good[2]]),
        ("a bool site", [{"site": True, "values": [value(4)]}, good[1], good[2]]),
        ("too many values", [{"site": 0, "values": [value(4), value(4)]}, good[1], good[2]]),
        ("an extra key", [{**good[0], "passed": True}, good[1], good[2]]),
        ("nothing", []),
    ]
    for name, forgery in forged:
        assert judge_script(test, forgery)[0] is False, name


def test_an_error_in_the_program_fails_its_assert_only_where_evaluated():
    test = parse_test("assert f(0) is None or f(1) == 2\nassert g() == 1")
    failed = {"error": "ZeroDivisionError: division by zero"}
    # f(0) is None: the `or` stops before f(1), as Python's would.
    assert judge_script(test, records([value(None), failed], [value(1)]))[0]
    verdict = judge_script(test, records([value(3), failed], [value(1)]))
    assert verdict == (
        False,
        "line 1: `assert f(0) is None or f(1) == 2` raised ZeroDivisionError: division by zero",
    )


def test_what_cannot_be_judged_outside_is_refused():
    refused = {
        "for a, b in [(1, 2)]:\n    assert f(a) == b": "inside a for",
        "def t():\n    assert f(1) == 2\nt()": "inside a functiondef",
        "assert f(1) == g(1)": "values that all come from the program",
        "f(1)": "no top-level assert",
        "x = f(1)\nassert x == f(2)": "values that all come from the program",
    }
    for test, reason in refused.items():
        with pytest.raises(UnjudgeableTest, match=reason):
            parse_test(test)
    with pytest.raises(ValueError, match="does not parse"):
        parse_test("assert (")


def test_humaneval_check_is_unrolled():
    test = parse_test(
        "METADATA = {}\n\ndef check(candidate):\n    assert candidate(2) == 4\n"
        "    assert candidate(0) == 0\n\ncheck(double)\n"
    )
    assert test.script.endswith("__looprl_emit__(0, lambda: double(2))\n"
                                "__looprl_emit__(1, lambda: double(0))")  # fmt: skip
    assert judge_script(test, records([value(4)], [value(0)]))[0]
    assert not judge_script(test, records([value(4)], [value(1)]))[0]


def test_expressions_too_large_to_build_here_fail():
    for text, leaf in (("assert 2 ** f() > 0", 10**6), ("assert 'a' * f() != ''", 10**9)):
        assert judge_script(parse_test(text), records([value(leaf)]))[0] is False


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
