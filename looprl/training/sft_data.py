"""Chats on disk -> training sequences for `looprl sft`, masked as RL masks them.

Owns: reading a JSONL file of chats (one {"messages": [...]} per line, OpenAI chat
format), each through the model's chat template, and the loss mask over what the
assistant said: each assistant message's text and the end-of-turn token that closes it,
exactly the tokens a policy samples in RL (the template's framing, the user's and the
tools' messages stay out). A bad line is skipped, named (file, line, field) and counted;
the rest train. Does not own the trainer or the loss.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from jinja2 import TemplateError

from looprl.types import Trajectory

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
    """One chat that cannot be trained on; the message names its field."""


@dataclass
class Chats:
    """The trainable chats of a file, and the lines that were not."""

    path: Path
    trajectories: list[Trajectory]
    skipped: list[str] = field(default_factory=list)  # "file:line: why", one per line


def load_chats(path: str | Path, tokenizer, max_tokens: int) -> Chats:
    """Every line of `path` as a Trajectory (loss mask on the assistant's tokens); lines
    that are not a chat, or longer than `max_tokens`, are skipped and named. Raises
    ValueError when the file is missing or no line is left."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"sft data file {path} does not exist")
    chats = Chats(path, [])
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                trajectory = chat_trajectory(row, tokenizer)
            except (json.JSONDecodeError, ChatError) as e:
                chats.skipped.append(f"{path}:{number}: {e}")
                continue
            if len(trajectory.input_ids) > max_tokens:
                chats.skipped.append(
                    f"{path}:{number}: {len(trajectory.input_ids)} tokens, over "
                    f"sft.max_tokens={max_tokens}"
                )
                continue
            trajectory.group_id = str(number)
            chats.trajectories.append(trajectory)
    for reason in chats.skipped[:5]:
        log.warning("Skipped %s", reason)
    if len(chats.skipped) > 5:
        log.warning("... and %d more lines skipped", len(chats.skipped) - 5)
    if not chats.trajectories:
        raise ValueError(f"{path} has no chat to train on ({len(chats.skipped)} lines skipped)")
    return chats


def chat_trajectory(row: object, tokenizer) -> Trajectory:
    """One chat {"messages": [...]} as token ids with the assistant's tokens in the loss
    mask. Raises ChatError naming the field that is wrong."""
    messages = _messages(row)
    full = _render(tokenizer, messages, generation_prompt=False)
    eos = tokenizer.eos_token or ""
    ids: list[int] = []
    mask: list[bool] = []
    position = 0  # in `full`, how far the segments have covered
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if not (through.startswith(before) and full.startswith(through)):
            raise ChatError(
                f"messages[{i}]: the chat template renders this assistant turn differently "
                "inside the whole chat (it rewrites earlier turns), so its tokens cannot be "
                "told apart"
            )
        said = through[len(before) :]
        if eos and eos in said:  # the end-of-turn token is sampled; what follows is not
            said = said[: said.index(eos) + len(eos)]
        _append(tokenizer, full[position : len(before)], False, ids, mask)
        _append(tokenizer, said, True, ids, mask)
        position = len(before) + len(said)
    _append(tokenizer, full[position:], False, ids, mask)
    if not any(mask):
        raise ChatError("messages: no assistant message has any text to train on")
    n = len(ids)
    return Trajectory(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        behavior_logprobs=torch.zeros(n),
        versions=torch.full((n,), -1, dtype=torch.int64),  # no engine sampled these
        reward=0.0,
    )


def _messages(row: object) -> list[dict]:
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        raise ChatError('a line must be a JSON object with a "messages" list')
    messages = row["messages"]
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ChatError(f"messages[{i}].role must be one of {list(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ChatError(f"messages[{i}].content must be a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatError("messages: no assistant message to learn from")
    return messages


def _render(tokenizer, messages: list[dict], *, generation_prompt: bool) -> str:
    if not messages:
        return ""
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False
        )
    except TemplateError as e:
        raise ChatError(f"messages: the model's chat template rejected them: {e}") from None


def _append(tokenizer, text: str, in_loss: bool, ids: list[int], mask: list[bool]) -> None:
    new = tokenizer(text, add_special_tokens=False).input_ids if text else []
    ids.extend(new)
    mask.extend([in_loss] * len(new))
