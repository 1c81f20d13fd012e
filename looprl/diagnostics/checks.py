"""`Check`: one finding about this machine or the config, and its fix when it is not
ok. `looprl doctor` prints them (looprl/commands/doctor.py); an env worker logs the
rendering ones when a render fails (rendering.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["ok", "warn", "fail"]


@dataclass
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""
    traceback: str = ""  # of a start-up check's failure, printed by `doctor --debug`
