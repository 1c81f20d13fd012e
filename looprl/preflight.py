"""The start-up checks that need no model: what `looprl train` runs before it imports
the training stack (a mistake is told in a second or two, not after a model load), and
what `looprl train --dry-run` and `looprl doctor` run too.

`check(cfg)` builds what a run would build from the config, the way the run builds it,
and closes it again; it reads no weights and starts no engine and no judge:

- extras: the packages the settings need (`extras.check_installed`, the trackers');
- models: model.path, train.teacher_path and the judge a run serves are folders the run
  can load, or 'default' (`models.check_model_path`: no config read, no conversion); a
  Hugging Face Hub id is not fetched, and says so;
- data: the task's rows, loaded as the run loads them (`tasks.load_task`): files that
  exist and hold usable rows, the task's reward function importable;
- workflow: imported and built with workflow.kwargs by `configured_workflow`, on the
  configured reward (`build_reward`; a judge the run would serve gets an address that is
  never called), then closed (`close_workflow`, then the reward's `aclose`); an env
  workflow's workers start and build the env once.

Each failure is a `Problem`: one short block (what is wrong, naming the setting; where,
the last line of the user's own file in the traceback; the fix) and the traceback, for
train.log and `--debug`. Does not own the checks of the machine
(looprl/commands/doctor.py) nor what needs the model: precision and memory are decided
by start-up (looprl/startup.py).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import looprl
from looprl import extras, trackers
from looprl.config import Config, ConfigError
from looprl.models import check_model_path
from looprl.rewards import Reward, build_reward, needs_judge_engine
from looprl.runs.paths import RunPaths
from looprl.tasks import Task, load_task
from looprl.workflows.protocol import close_workflow
from looprl.workflows.resolution import (
    RLVR_WORKFLOW,
    configured_workflow,
    uses_configured_reward,
)

# The judge a run serves on its own engine is not started by the check: its reward is
# built on this address, which nothing calls.
UNSERVED_JUDGE = ("http://127.0.0.1:9/v1", "unserved")
_LIBRARY_DIRS = [
    Path(p).resolve() for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, *looprl.__path__}
]


@dataclass(frozen=True)
class Problem:
    """A setting that would stop the run. `part`: what was checked (workflow, data,
    models, reward, extras), as doctor's row names it; `what`: the message, naming the
    setting; `where`: the user's file:line it was raised at, if in their code; `fix`:
    what to change, where `what` does not already say it; `traceback`: all of it."""

    part: str
    what: str
    where: str = ""
    fix: str = ""
    traceback: str = ""

    def detail(self) -> str:
        """What and where, for doctor's table."""
        return f"{self.what} (at {self.where})" if self.where else self.what

    def block(self) -> str:
        """The one block a terminal shows: what (setting), where, and the fix."""
        return f"{self.detail()}. Fix: {self.fix}" if self.fix else self.detail()


async def check(cfg: Config) -> list[Problem]:
    """Every problem of `cfg` found without the model, in the order the run would meet
    them; [] when the run can start."""
    problems = [*_check_extras(cfg), *_check_models(cfg)]
    task = None
    try:
        with _quiet("looprl.tasks"):  # the run warns of skipped rows when it loads them
            task = load_task(cfg.task)
    except Exception as e:  # noqa: BLE001 (a problem to report, whatever it is)
        # The user's code load_task runs is task.reward's module; the rest reads data.
        setting = (
            f"task.reward={cfg.task.reward}" if _user_frame(e) else f"task.name={cfg.task.name}"
        )
        problems.append(_problem("data", setting, e))
    if task is not None or cfg.workflow.path != RLVR_WORKFLOW:  # RLVR reads the task
        problems += await _check_workflow(cfg, task)
    return problems


def _check_extras(cfg: Config) -> list[Problem]:
    problems = []
    for check_installed in (extras.check_installed, trackers.check_installed):
        try:
            check_installed(cfg)
        except ConfigError as e:
            problems.append(_problem("extras", "", e))
    return problems


def _check_models(cfg: Config) -> list[Problem]:
    paths = {"model.path": cfg.model.path}
    if cfg.train.teacher_path:
        paths["train.teacher_path"] = cfg.train.teacher_path
    if needs_judge_engine(cfg) and uses_configured_reward(cfg):
        paths["reward.judge.model"] = cfg.reward.judge.model
    problems = []
    for field, path in paths.items():
        try:
            check_model_path(path, field)
        except (OSError, ImportError) as e:
            problems.append(_problem("models", field, e))
    return problems


async def _check_workflow(cfg: Config, task: Task | None) -> list[Problem]:
    """Build the workflow (and the reward it is scored by) as the run does, and close
    them."""
    reward: Reward | None = None
    try:
        if uses_configured_reward(cfg):
            judge_url = UNSERVED_JUDGE if needs_judge_engine(cfg) else None
            reward = build_reward(cfg, task, judge_url)
    except Exception as e:  # noqa: BLE001
        return [_problem("reward", f"reward.type={cfg.reward.type}", e)]
    try:
        # The run's frames folder (env.frames_every), named only: nothing is written there.
        workflow = configured_workflow(cfg, task, reward, frames_dir=RunPaths(cfg.run_dir).frames)
        await close_workflow(workflow)
    except Exception as e:  # noqa: BLE001
        setting = f"workflow.command={cfg.workflow.command}"
        if cfg.workflow.mode == "python":
            setting = f"workflow.path={cfg.workflow.path}"
        return [_problem("workflow", setting, e)]
    finally:
        if reward is not None:
            await reward.aclose()
    return []


def _problem(part: str, setting: str, error: BaseException) -> Problem:
    """The Problem of `error`. Raised by looprl: its message, which names the setting
    and the fix itself. Raised in the user's own code (a module that fails to import, a
    constructor that raises): the setting that runs that code, the exception, and its
    last line in their file. Raised in a library: the setting, the exception and where."""
    full = "".join(traceback.format_exception(error))
    where = _user_frame(error)
    frames = traceback.extract_tb(error.__traceback__)
    if where is None and frames and _in_looprl(frames[-1].filename):
        return Problem(part, str(error), traceback=full)
    cause = _innermost(error)
    what = f"{setting}: {type(cause).__name__}: {cause}" if setting else str(cause)
    if where is None:
        last = traceback.extract_tb(cause.__traceback__)[-1:]
        where = "".join(f"{f.filename}:{f.lineno} in {f.name}" for f in last)
        return Problem(part, what, where, traceback=full)
    return Problem(part, what, where, "correct your code at that line", full)


def _innermost(error: BaseException) -> BaseException:
    """The first exception of `error`'s chain (a cause looprl wrapped in its message)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _user_frame(error: BaseException) -> str | None:
    """'file:line' of the last frame outside looprl, Python and installed packages in
    `error`'s chain (the user's own code), or of a syntax error in their file."""
    found = None
    chain: BaseException | None = error
    while chain is not None:
        if isinstance(chain, SyntaxError) and chain.filename and _is_user_file(chain.filename):
            return f"{chain.filename}:{chain.lineno}"
        for frame in traceback.extract_tb(chain.__traceback__):
            if _is_user_file(frame.filename):
                found = f"{frame.filename}:{frame.lineno} in {frame.name}"
        if found is not None:
            return found
        chain = chain.__cause__
    return None


def _is_user_file(filename: str) -> bool:
    """A Python file of the user's: not looprl's, Python's or a package's; not `<frozen
    ...>` nor a compiled module's source (Cython's 'pyarrow/error.pxi')."""
    path = Path(filename)
    if path.suffix != ".py" or not path.is_file():
        return False
    return not any(path.resolve().is_relative_to(folder) for folder in _LIBRARY_DIRS)


def _in_looprl(filename: str) -> bool:
    return any(Path(filename).resolve().is_relative_to(p) for p in looprl.__path__)


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[Any]:
    """`logger_name`'s warnings held back while the check repeats what the run does."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
