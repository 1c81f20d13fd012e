"""Every command's output read through a pipe at 80 columns, as a CI log, `| less` or a
file gets it: no line wider than 80, nothing cut with '…', and the long cells (paths,
commands, a whole fix) all there once the wrapping is undone.

Each command runs as in tests/integration/test_cli.py (`python -m looprl.cli` in a
subprocess); they run all at once in one fixture, since their start-up is most of
their time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import pytest
import typer

from looprl.cli import app
from looprl.diagnostics.rendering import check_rendering
from tests.support.synthetic_run import write_synthetic_run

WIDTH = 80
# TERMINAL_WIDTH would win over COLUMNS in typer's help.
UNSET = ("RAY_ADDRESS", "MUJOCO_GL", "TERMINAL_WIDTH")
ENV = {k: v for k, v in os.environ.items() if k not in UNSET} | {
    "COLUMNS": str(WIDTH),
    "NO_COLOR": "1",
    "PYTHONIOENCODING": "utf-8",
}
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _command_names(group: click.Group, parents: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and subcommand of `group`, as the words that name it."""
    names = [parents]
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            names += _command_names(command, (*parents, name))
        else:
            names.append((*parents, name))
    return names


HELP = {
    " ".join(("looprl", *words, "--help")): [*words, "--help"]
    for words in _command_names(typer.main.get_command(app))
}
RUNS = [
    *HELP,
    "doctor",
    "show",
    "rollout",
    "debug consistency",
    "a typo'd field",
    "a value with brackets",
    "an unknown option",
    "debug stacks of a folder",
    "convert-checkpoint untrusted",
]


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory) -> Path:
    """A folder whose path is longer than any column at 80 wide, so that it must fold."""
    path = tmp_path_factory.mktemp("out") / ("a-folder-name-long-enough-to-fold-" * 2)
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def doctor_env(long_dir) -> dict[str, str]:
    """MUJOCO_GL=egl with glvnd pointed at a missing vendor file: MUJOCO_GL fails, naming
    that file's (long) path in its detail, with a fix longer than a line."""
    return {**ENV, "MUJOCO_GL": "egl", "__EGL_VENDOR_LIBRARY_FILENAMES": str(long_dir / "x.json")}


@pytest.fixture(scope="module")
def printed(tiny_model_dir, long_dir, doctor_env) -> dict[str, subprocess.CompletedProcess]:
    """What each of RUNS printed, stdout then stderr."""
    run_dir = write_synthetic_run(long_dir / "run", steps=1, rows_per_step=4, group_size=2)
    runs = {name: (args, ENV) for name, args in HELP.items()}
    runs |= {
        "doctor": (  # an env played: doctor checks rendering only for one
            ["doctor", f"run.fileroot={long_dir}", "env.name=gymnasium:FrozenLake-v1"],
            doctor_env,
        ),
        "show": (["show", str(run_dir)], ENV),
        "rollout": (
            ["rollout", "--rows", "1", "--out", str(long_dir / "rollouts.jsonl")]
            + [f"model.path={tiny_model_dir}", "rollout.group_size=2", "sampling.max_new_tokens=4"],
            ENV,
        ),
        "debug consistency": (
            ["debug", "consistency", f"model.path={tiny_model_dir}", "sampling.max_new_tokens=4"]
            + [f"run.fileroot={long_dir / 'consistency'}", "--samples", "2", "--worst", "2"],
            ENV,
        ),
        "a typo'd field": (["train", "train.lrr=1"], ENV),
        "a value with brackets": (["train", "train.lr=2e-5[bad]"], ENV),
        "an unknown option": (["train", "--bogus"], ENV),
        "debug stacks of a folder": (["debug", "stacks", str(long_dir)], ENV),
        "convert-checkpoint untrusted": (["convert-checkpoint", str(long_dir)], ENV),
    }

    def run(args_env) -> subprocess.CompletedProcess:
        args, env = args_env
        return subprocess.run(
            [sys.executable, "-m", "looprl.cli", *args],
            cwd=long_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )

    with ThreadPoolExecutor(len(runs)) as pool:
        return dict(zip(runs, pool.map(run, runs.values()), strict=True))


def _text(done: subprocess.CompletedProcess) -> str:
    return ANSI.sub("", done.stdout + done.stderr)


def _squeezed(text: str) -> str:
    """`text` without whitespace: the same for a cell however it was wrapped or folded."""
    return "".join(text.split())


def _column(text: str, index: int) -> str:
    """Column `index` (0: the first) of the table rows in `text`, top to bottom,
    squeezed: a cell's text whole, whatever the wrapping split it into."""
    rows = [re.split("[│┃]", line)[1:-1] for line in text.splitlines()]
    return _squeezed("".join(cells[index] for cells in rows if len(cells) > index))


@pytest.mark.parametrize("name", RUNS)
def test_no_line_is_wider_than_80_or_cut(printed, name):
    text = _text(printed[name])
    assert text.strip(), f"{name} printed nothing"
    wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not wide, f"{name}: {len(wide)} line(s) over {WIDTH} columns:\n" + "\n".join(wide)
    assert "…" not in text, f"{name} cut something:\n{text}"


def test_help_exits_0(printed):
    assert {name: printed[name].returncode for name in HELP} == dict.fromkeys(HELP, 0)


def test_doctor_prints_a_long_detail_and_fix_whole(printed, doctor_env):
    done = printed["doctor"]
    assert done.returncode == 1, _text(done)  # the MUJOCO_GL check failed
    mujoco_gl = next(c for c in check_rendering(doctor_env) if c.name == "MUJOCO_GL")
    assert mujoco_gl.status == "fail" and len(mujoco_gl.fix) > WIDTH
    assert _squeezed(mujoco_gl.detail + "fix: " + mujoco_gl.fix) in _column(done.stdout, 2)


def test_show_prints_the_whole_row(printed):
    done = printed["show"]
    assert done.returncode == 0, _text(done)
    said = _squeezed(done.stdout)
    assert _squeezed("error: ValueError: the reward function failed") in said
    assert "needle1x0" in said


def test_rollout_prints_its_summary_and_the_whole_path(printed, long_dir):
    done = printed["rollout"]
    assert done.returncode == 0, _text(done)
    assert "rollouts" in _column(done.stdout, 0) and "trajectories" in _column(done.stdout, 0)
    assert _squeezed(f"wrote 2 trajectories to {long_dir / 'rollouts.jsonl'}") in _squeezed(
        done.stderr
    )


def test_consistency_tables_keep_their_headings(printed):
    done = printed["debug consistency"]
    assert done.returncode == 0, _text(done)
    assert "KL(engine||trainer)" in _column(done.stdout, 5)
    assert "trainerlogprob" in _column(done.stdout, 4)


def test_config_errors_say_what_the_user_wrote(printed):
    typo, brackets = printed["a typo'd field"], printed["a value with brackets"]
    assert typo.returncode == brackets.returncode == 2
    assert _squeezed("train.lrr: unknown field; did you mean 'lr'?") in _squeezed(typo.stderr)
    # Not taken for rich markup: '[bad]' is what the user wrote and stays.
    assert "train.lr='2e-5[bad]'" in _squeezed(brackets.stderr)
    assert "No such option: --bogus" in printed["an unknown option"].stderr


def test_errors_print_a_long_path_whole(printed, long_dir):
    done = printed["debug stacks of a folder"]
    assert done.returncode == 2
    assert _squeezed(f"error: '{long_dir}' is neither a pid") in _squeezed(done.stderr)
    done = printed["convert-checkpoint untrusted"]
    assert done.returncode == 2 and "--trust-pickle" in done.stderr
