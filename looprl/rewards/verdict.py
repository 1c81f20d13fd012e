"""The verdict on a code test, from the records its boxes sent back: data checked here,
nothing of the program evaluated.

Owns: whether the program's box reported every assert's values in order and ran to its
end (`program_values`, which also gives the values to forward to the judge box), whether
the judge box found every assert true (`judge_verdicts`), and a stdin/stdout case's
comparison (`judge_stdio`). Not the split (cases.py) nor the boxes (sandbox.py).
"""

from __future__ import annotations

import json
from typing import Any

from looprl.rewards.cases import ScriptTest, StdioTest


def program_values(test: ScriptTest, records: list[dict]) -> tuple[str | None, str]:
    """(the leaves' values as the judge box's data, why not) from the program box's
    records: every assert reported once, in order, each leaf a value, an error or an
    opaque object, then done. The values stay JSON; nothing is decoded here."""
    values: list[list] = []
    for record in records:
        site = len(values)
        if site == len(test.sites):
            if record != {"done": True} or record is not records[-1]:
                return None, f"a results record out of place: {str(record)[:120]}"
            try:
                return json.dumps(values), ""
            except (ValueError, RecursionError):
                return None, "the program's values are nested too deeply to forward"
        leaves = record.get("values")
        if (
            set(record) != {"site", "values"}
            or type(record["site"]) is not int
            or record["site"] != site
            or not isinstance(leaves, list)
            or len(leaves) != test.sites[site].leaves
            or not all(_is_entry(v) for v in leaves)
        ):
            return None, f"a results record out of place: {str(record)[:120]}"
        values.append(leaves)
    if len(values) < len(test.sites):
        site = test.sites[len(values)]
        return None, f"line {site.line}: `{site.source}` was never reached"
    return None, "the test did not run to its end"


def _is_entry(entry: Any) -> bool:
    if not isinstance(entry, dict) or len(entry) != 1:
        return False
    (key, value), = entry.items()  # fmt: skip
    return key == "value" or (key in ("error", "opaque") and isinstance(value, str))


def judge_verdicts(test: ScriptTest, records: list[dict]) -> tuple[bool, str]:
    """(passed, why not) from the judge box's records: every assert's verdict, in
    order, each passed, then done."""
    for index, site in enumerate(test.sites):
        if index >= len(records):
            return False, f"line {site.line}: `{site.source}` was never judged"
        record = records[index]
        if (
            set(record) != {"site", "passed", "why"}
            or record["site"] != index
            or type(record["passed"]) is not bool
        ):
            return False, f"a verdict record out of place: {str(record)[:120]}"
        if not record["passed"]:
            return False, f"line {site.line}: `{site.source}` {record['why']}"[:400]
    if records[len(test.sites) :] != [{"done": True}]:
        return False, "the judge did not run to its end"
    return True, ""


def judge_stdio(test: StdioTest, stdout: str, returncode: int | None) -> tuple[bool, str]:
    if _lines(stdout) != _lines(test.output):
        return False, "the output differs from the expected output"
    if returncode != 0:
        return False, f"the program exited with status {returncode}"
    return True, ""


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines
