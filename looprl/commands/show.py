"""`looprl show RUN_DIR`: one trained rollout from the run's trajectory files, in the
terminal.

Prints the header (step, group, reward, advantage, staleness, policy version), each chat
call's messages and reply, then the token sequence coloured by the loss mask (sampled
tokens highlighted, prompt tokens dim), with errors and concatenation breaks in red, and
the episode's frames file when env.frames_every saved one. Every string of the row is
printed with its control characters escaped (`visible`): a model's output may hold
terminal escapes (OSC 52 writes the clipboard, CSI 2J clears the screen) that must show
as text, not act. Reads only what
looprl/runs/trajectories.py and envs/frames.py write, where `RunPaths` (looprl/runs/
paths.py) says they are; knows nothing of training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.rule import Rule
from rich.text import Text

from looprl.runs.paths import RunPaths, frame_file
from looprl.runs.trajectories import TrajectoryFileError, list_steps, read_step

# Alternating backgrounds, so that neighbouring sampled tokens show as two tokens.
SAMPLED_STYLES = ("black on green3", "black on dark_sea_green2")
PROMPT_STYLE = "dim"
# The C0 and C1 control characters but newline and tab, written as Python escapes them.
_ESCAPED = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if chr(c) not in "\n\t"}


def pick_rollout(
    run_dir: Path | RunPaths, *, step: int | None = None, index: int = 0, group: str | None = None
) -> tuple[Path, dict[str, Any], int]:
    """The file, the row and the number of rows it was chosen among: row `index` of step
    `step` (default: the latest written), among the rows of `group` when given. Raises
    TrajectoryFileError with a sentence saying what exists instead."""
    paths = RunPaths.of(run_dir)
    steps = dict(list_steps(paths))
    if not steps:
        raise TrajectoryFileError(
            f"{paths.root}: no trajectory files ({paths.trajectories.name}/step_*.parquet); "
            "they are written by `looprl train` every metrics.trajectories_every steps"
        )
    chosen = max(steps) if step is None else step
    if chosen not in steps:
        raise TrajectoryFileError(
            f"{paths.root}: no trajectory file for step {chosen}; steps written: "
            f"{_ranges(sorted(steps))}"
        )
    rows = read_step(steps[chosen])
    if group is not None:
        rows = [r for r in rows if r["group_id"] == group]
        if not rows:
            raise TrajectoryFileError(f"{steps[chosen]}: no row of group {group!r}")
    if not 0 <= index < len(rows):
        raise TrajectoryFileError(
            f"{steps[chosen]}: --index {index} is out of range: there are {len(rows)} rows"
            + (f" in group {group!r}" if group is not None else "")
        )
    return steps[chosen], rows[index], len(rows)


def show_rollout(
    run_dir: Path | RunPaths,
    *,
    step: int | None = None,
    index: int = 0,
    group: str | None = None,
    console: Console,
) -> None:
    paths = RunPaths.of(run_dir)
    path, row, count = pick_rollout(paths, step=step, index=index, group=group)
    row = visible(row)
    console.print(Rule(f"{path.name}: row {index} of {count}"))
    console.print(header(row))
    frames = frame_file(paths.frames, row["session_id"])
    if frames.is_file():  # saved by env.frames_every
        console.print(Text(f"frames: {frames}", style="cyan"))
    for k, call in enumerate(row["calls"]):
        print_call(console, k + 1, call)
    console.print(Rule("tokens (highlighted: sampled, in the loss; dim: prompt)"))
    console.print(tokens(row))
    for reason in row["concat_breaks"]:
        console.print(Text(f"concat break: {reason}", style="red"))
    if row["error"]:
        console.print(Text(f"error: {row['error']}", style="red"))


def print_call(console: Console, number: int, call: dict[str, Any], *, left_out: int = 0) -> None:
    """One call of `trajectory.call_records` (its strings already `visible`): its
    messages (`left_out`: how many earlier ones the caller dropped), the reply, its tool
    calls, finish reason and reward. `looprl debug workflow` prints its calls with it too."""
    console.print(Rule(f"call {number}: {call['completion_id']}", style="cyan"))
    if left_out:
        console.print(Text(f"({left_out} earlier message(s) not shown)", style="dim"))
    for message in call["messages"]:
        console.print(_message(message))
    console.print(Text.assemble(("assistant (reply): ", "bold green"), call["reply"]))
    for tool_call in call["tool_calls"]:
        console.print(Text(f"  tool call: {json.dumps(tool_call)}", style="green"))
    reward = "-" if call["reward"] is None else f"{call['reward']:.4g}"
    console.print(Text(f"finish_reason {call['finish_reason']}, reward {reward}", "dim"))


def visible(value: Any) -> Any:
    r"""`value` (a row or any part of it) with each string's control characters but
    newline and tab written as escapes, so that none reaches the terminal.

    >>> visible({"reply": ["a\x1b[2J", "b\n\tc\x9b"]})
    {'reply': ['a\\x1b[2J', 'b\n\tc\\x9b']}
    """
    if isinstance(value, str):
        return value.translate(_ESCAPED)
    if isinstance(value, dict):
        return {key: visible(item) for key, item in value.items()}
    if isinstance(value, list):
        return [visible(item) for item in value]
    return value


def header(row: dict[str, Any]) -> Text:
    sampled = sum(row["loss_mask"])
    lines = [
        f"step {row['step']}  group {row['group_id']}  sample {row['sample_index']}  "
        f"dataset row {row['row_id'] or '-'}  session {row['session_id']}",
        f"reward {row['reward']:.4g}  advantage {row['advantage']:+.4g}  staleness "
        f"{row['staleness']}  policy version {row['policy_version']}  "
        f"truncated {'yes' if row['truncated'] else 'no'}  tokens {len(row['token_ids'])} "
        f"({sampled} sampled)",
    ]
    trainer = row["trainer_logprobs"]
    if trainer is not None and sampled:
        gaps = [
            abs(t - e)
            for t, e, m in zip(trainer, row["engine_logprobs"], row["loss_mask"], strict=True)
            if m
        ]
        lines.append(f"engine vs trainer logprob |diff|: mean {sum(gaps) / sampled:.3g}")
    return Text("\n".join(lines), style="bold")


def tokens(row: dict[str, Any]) -> Text:
    """The sequence, each token styled by the loss mask."""
    text = Text()
    k = 0
    for piece, in_loss in zip(row["token_text"], row["loss_mask"], strict=True):
        if in_loss:
            text.append(piece, style=SAMPLED_STYLES[k % 2])
            k += 1
        else:
            text.append(piece, style=PROMPT_STYLE)
    return text


def _message(message: dict[str, Any]) -> Text:
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts
        content = "\n".join(part.get("text", "") for part in content)
    text = Text.assemble((f"{message['role']}: ", "bold"), content or "")
    for tool_call in message.get("tool_calls") or []:
        text.append(f"\n  tool call: {json.dumps(tool_call)}", style="green")
    return text


def _ranges(steps: list[int]) -> str:
    """1, 2, 3, 5 -> '1-3, 5'."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
