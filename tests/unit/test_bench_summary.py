"""`make bench`'s summary (bench/common.py, bench/headline.py): the rows' ratios, the CPU
label, merging a re-run part into an earlier summary, the Markdown table, and the driver
on parts that are real tiny Python processes (one writes its JSON, one crashes, one
writes nothing)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # scripts, not a package

import common  # noqa: E402
import headline  # noqa: E402
from common import Row, cpu_label  # noqa: E402

from looprl.precision import CPU  # noqa: E402


def row(looprl, baseline, better, **fields) -> Row:
    return Row(
        figure=fields.pop("figure", "x"),
        looprl=looprl,
        baseline=baseline,
        baseline_name=fields.pop("baseline_name", "b"),
        unit=fields.pop("unit", "u"),
        better=better,
        **fields,
    )


def test_ratio_is_above_one_when_looprl_is_better_either_way():
    assert row(676, 250, "higher").ratio == pytest.approx(2.704)  # tok/s: 676 / 250
    assert row(125, 250, "higher").ratio == pytest.approx(0.5)
    assert row(4.0, 10.0, "lower").ratio == pytest.approx(2.5)  # seconds: 10 / 4
    assert row(20.0, 10.0, "lower").ratio == pytest.approx(0.5)


def test_no_ratio_without_a_baseline_or_with_zero_to_divide_by():
    assert row(92.0, None, "higher").ratio is None
    assert row(5.0, 0.0, "higher").ratio is None
    assert row(0.0, 3.0, "lower").ratio is None


def test_row_orientation_must_be_named():
    with pytest.raises(ValueError, match=r"better='faster'.*'higher'.*'lower'"):
        row(1.0, 2.0, "faster")


def test_row_as_dict_has_the_contract_fields():
    got = row(3.0, 6.0, "lower", figure="step", baseline_name="full", unit="s", note="n")
    assert got.as_dict() == {
        "figure": "step",
        "looprl": 3.0,
        "baseline": 6.0,
        "baseline_name": "full",
        "unit": "s",
        "better": "lower",
        "ratio": 2.0,
        "note": "n",
    }


@pytest.mark.parametrize(
    ("flags", "forced", "label"),
    [
        ({"avx2", "avx512f", "avx512bw", "avx512_bf16"}, None, "[AVX-512 BF16]"),
        ({"avx2", "avx512f", "avx512bw", "avx512_bf16"}, "avx2", "[AVX2, forced]"),
        ({"avx2"}, None, "[AVX2]"),
        ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, None, "[AMX]"),
    ],
)
def test_cpu_label_names_the_kind_as_benchmarks_md_does(flags, forced, label):
    kind = CPU("AMD EPYC", 2, "x86_64", frozenset(flags)).kind
    assert cpu_label(kind, forced) == label


def test_machine_says_when_the_cpu_is_forced(monkeypatch):
    monkeypatch.setenv("LOOPRL_FORCE_CPU", "avx2")
    got = common.machine()
    assert got["label"] == "[AVX2, forced]" and got["forced_cpu"] == "avx2"
    assert {"kind", "model", "flags", "cores", "torch"} <= set(got)


def test_script_command_leaves_out_where_the_json_went(monkeypatch):
    monkeypatch.delenv("LOOPRL_FORCE_CPU", raising=False)
    argv = [str(common.ROOT / "bench/engine.py"), "--json", "/tmp/e.json", "--repeats", "1"]
    assert common.script_command(argv) == "python bench/engine.py --repeats 1"
    monkeypatch.setenv("LOOPRL_FORCE_CPU", "avx2")
    argv = [str(common.ROOT / "bench/lora.py"), "--json=/tmp/l.json", "--ranks", "16"]
    assert common.script_command(argv) == "LOOPRL_FORCE_CPU=avx2 python bench/lora.py --ranks 16"


def test_write_result_writes_the_contract(tmp_path):
    rows = [row(8.0, 10.0, "lower", figure="step", unit="s")]
    common.write_result(tmp_path / "r.json", "lora", rows, {"runs": 2}, command="python x")
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["part"] == "lora" and got["command"] == "python x"
    assert got["rows"][0]["ratio"] == pytest.approx(1.25) and got["details"] == {"runs": 2}
    assert re.fullmatch(r"[0-9a-f]{7,}(-dirty)?|unknown", got["commit"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", got["date"])
    assert got["machine"]["label"].startswith("[")


MACHINE = {"label": "[AVX-512 BF16]", "model": "AMD EPYC", "flags": "avx2", "cores": 2}
MACHINE |= {"torch": "2.13.0+cpu"}


def entry(date: str, commit: str, rows: list[Row], **fields) -> dict:
    return {
        "part": fields.get("part", "p"),
        "command": "python bench/p.py",
        "status": "ok",
        "rows": [r.as_dict() for r in rows],
        "details": {},
        "date": date,
        "commit": commit,
        "machine": MACHINE,
        "minutes": 1.0,
        "log": "bench/results/logs/p.log",
        **fields,
    }


def test_merge_replaces_only_the_rerun_part_and_keeps_the_others_dates():
    old = {
        "updated": {"date": "2026-11-01 10:00 UTC", "commit": "aaaaaaa", "machine": MACHINE},
        "parts": {
            "engine": entry("2026-11-01 10:00 UTC", "aaaaaaa", [row(600, 300, "higher")]),
            "lora": entry("2026-11-01 10:20 UTC", "aaaaaaa", [row(5.0, 6.0, "lower")]),
        },
    }
    new_lora = entry("2026-11-02 09:00 UTC", "bbbbbbb", [row(4.0, 6.0, "lower")])
    stamp = {"date": "2026-11-02 09:00 UTC", "commit": "bbbbbbb", "machine": MACHINE}
    merged = headline.merge(old, {"lora": new_lora}, stamp, order=["engine", "lora"])
    assert list(merged["parts"]) == ["engine", "lora"]
    assert merged["parts"]["engine"] == old["parts"]["engine"]
    assert merged["parts"]["lora"]["commit"] == "bbbbbbb"
    assert merged["parts"]["lora"]["rows"][0]["looprl"] == 4.0
    assert merged["updated"] == stamp


def test_merge_orders_parts_as_the_registry_does():
    old = {"parts": {"lora": entry("d", "c", []), "gone": entry("d", "c", [])}}
    merged = headline.merge(old, {"engine": entry("d", "c", [])}, {}, order=["engine", "lora"])
    assert list(merged["parts"]) == ["engine", "lora", "gone"]


def test_markdown_table_has_one_line_per_row_and_the_failures_below():
    forced = MACHINE | {"label": "[AVX2, forced]"}
    summary = {
        "updated": {"date": "2026-11-02 09:00 UTC", "commit": "bbbbbbb", "machine": MACHINE},
        "parts": {
            "engine": entry(
                "2026-11-01 10:00 UTC",
                "aaaaaaa",
                [
                    row(676.4, 249.0, "higher", figure="generation", unit="tok/s", note="a"),
                    row(4.12, None, "lower", figure="wall time", unit="min"),
                ],
                machine=forced,
            ),
            "lora": entry(
                "2026-11-02 09:00 UTC",
                "bbbbbbb",
                [],
                status="failed",
                error="exited with status 3",
                log_tail="Traceback\nValueError: no | pipe",
            ),
        },
    }
    md = headline.render(summary)
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert table == [
        "| part | figure | looprl | baseline | ratio | measured |",
        "|---|---|---:|---|---:|---|",
        "| engine | generation (a) | 676 tok/s | 249 tok/s (b) | 2.72x "
        "| 2026-11-01 10:00 UTC, aaaaaaa, [AVX2, forced] |",
        "| engine | wall time | 4.12 min | none |  "
        "| 2026-11-01 10:00 UTC, aaaaaaa, [AVX2, forced] |",
        "| lora | **failed**: exited with status 3 | | | | 2026-11-02 09:00 UTC, bbbbbbb |",
    ]
    assert "commit bbbbbbb on [AVX-512 BF16] AMD EPYC" in md
    assert "## lora failed: exited with status 3" in md
    assert "```\nTraceback\nValueError: no | pipe\n```" in md


def python_part(code: str) -> headline.Part:
    return headline.Part(("-c", code), minutes=0.01)


# A part as a bench script is one: it writes its JSON to the path after --json, echoing
# the arguments it got.
WRITES = """
import json, sys
rows = [{"figure": "f", "looprl": 2.0, "baseline": 1.0, "baseline_name": "b", "unit": "s",
         "better": "lower", "ratio": 0.5, "note": ""}]
json.dump({"part": "good", "command": "python good.py", "rows": rows,
           "details": {"argv": sys.argv}}, open(sys.argv[sys.argv.index("--json") + 1], "w"))
print("good part done")
"""
FAKE_PARTS = {
    "good": python_part(WRITES),
    "crash": python_part(
        "print('step 1\\rstep 2', flush=True); raise SystemExit('crashed at step 2')"
    ),
    "silent": python_part("print('nothing written')"),
}


def test_driver_records_failed_parts_with_their_log_tail_and_exits_1(tmp_path, capsys):
    status = headline.main(
        ["--parts", "good", "crash", "silent"], parts=FAKE_PARTS, results=tmp_path
    )
    assert status == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    good, crash, silent = (summary["parts"][name] for name in ["good", "crash", "silent"])
    assert good["status"] == "ok" and good["rows"][0]["looprl"] == 2.0
    assert crash["status"] == "failed" and crash["error"] == "exited with status 1"
    command, *output = crash["log_tail"].split("\n")  # a progress line: its last state
    assert command.startswith("$ ") and output == ["step 2", "crashed at step 2"]
    assert crash["rows"] == [] and crash["command"].startswith("python -c ")
    assert silent["status"] == "failed" and "wrote no JSON" in silent["error"]
    assert (tmp_path / "logs" / "good.log").read_text().endswith("good part done\n")
    assert "## crash failed: exited with status 1" in (tmp_path / "summary.md").read_text()
    out = capsys.readouterr().out
    assert "part 2/3: crash (about 0.01 min) ..." in out and "good part done" in out


def test_driver_rerun_of_one_part_keeps_the_others(tmp_path):
    assert headline.main(["--parts", "good", "crash"], parts=FAKE_PARTS, results=tmp_path) == 1
    before = json.loads((tmp_path / "summary.json").read_text())["parts"]
    fixed = FAKE_PARTS | {"crash": python_part(WRITES)}
    assert headline.main(["--parts", "crash"], parts=fixed, results=tmp_path) == 0
    after = json.loads((tmp_path / "summary.json").read_text())["parts"]
    assert after["good"] == before["good"]
    assert after["crash"]["status"] == "ok" and after["crash"]["rows"]


def test_driver_passes_the_arguments_after_dashes_to_one_part(tmp_path):
    headline.main(
        ["--parts", "good", "--", "train.total_steps=1"], parts=FAKE_PARTS, results=tmp_path
    )
    argv = json.loads((tmp_path / "summary.json").read_text())["parts"]["good"]["details"]["argv"]
    assert argv[:2] == ["-c", "train.total_steps=1"] and argv[2] == "--json"
    with pytest.raises(SystemExit) as exited:
        headline.main(["--parts", "good", "crash", "--", "x=1"], parts=FAKE_PARTS, results=tmp_path)
    assert exited.value.code == 2
