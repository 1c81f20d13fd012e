"""Prompt token ids from a request.

Owns: the chat prompt (messages and tools through the model's chat template, then the
forced start of a tool call; within a session, an earlier call's exact token ids where
the new prompt's text starts with that call's) and tokenizing text with a 400 naming
the field it came from. Does not own how tools and tool-call messages are rendered
(tools.py) nor what a prompt may hold (limits.py).
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from looprl.gateway import tools as tools_lib
from looprl.gateway.errors import APIError
from looprl.gateway.schemas import ChatRequest
from looprl.gateway.sessions import Session


def request_prompt(
    tokenizer: PreTrainedTokenizerBase,
    req: ChatRequest,
    session: Session | None,
    *,
    native_tools: bool,
) -> tuple[list[int], list[dict], str]:
    """`req`'s prompt ids (`chat_prompt`), the tools the model sees, and the forced start
    of a tool call the prompt ends with ("" when `tool_choice` forces none)."""
    tools, tool_choice = req.active_tools()
    prefix = tools_lib.forced_prefix(tool_choice)
    ids = chat_prompt(tokenizer, req, tools, prefix, session, native_tools=native_tools)
    return ids, tools, prefix


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    req: ChatRequest,
    tools: list[dict],
    prefix: str,
    session: Session | None,
    *,
    native_tools: bool,
) -> list[int]:
    """Prompt token ids: the messages (and tools) through the chat template, then the
    forced start of a tool call if any; where the text starts with an earlier call's,
    that call's exact ids. Raises APIError 400 when the template refuses.

    `native_tools`: the template renders `tools` itself (else tools.py puts them in
    the messages)."""
    messages = tools_lib.render_messages(
        [m.for_template() for m in req.messages],
        tools,
        native=native_tools,
        sampled_texts=session.sampled_texts if session is not None else {},
    )
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools if native_tools and tools else None,
            add_generation_prompt=True,
            tokenize=False,
        )
    except TemplateError as e:
        raise APIError(
            400, f"the model's chat template rejected the messages: {e}", "messages"
        ) from None
    text += prefix
    known_ids, known_text = _sampled_prefix(tokenizer, text, session)
    rest = text[len(known_text) :]
    return known_ids + tokenize(tokenizer, rest, "messages", add_special_tokens=False)


def tokenize(tokenizer: PreTrainedTokenizerBase, text: str, field: str, **kwargs: Any) -> list[int]:
    """Token ids of `text`; a 400 naming `field` for text no tokenizer takes (a lone
    surrogate somewhere the schema does not check, e.g. inside tool parameters)."""
    try:
        return list(tokenizer(text, **kwargs).input_ids)
    except (TypeError, UnicodeEncodeError) as e:
        raise APIError(
            400, f"{field}: the tokenizer cannot encode this text ({e})", field
        ) from None


def _sampled_prefix(
    tokenizer: PreTrainedTokenizerBase, text: str, session: Session | None
) -> tuple[list[int], str]:
    """The token ids of the session's latest call (prompt + sampled output) whose text
    the new prompt's text starts with, and that text; ([], "") when none.

    Re-tokenizing a sampled output can split it into other ids than the model
    sampled (a different but equally valid BPE split); reusing the ids keeps the new
    prompt an extension of what was sampled, so the session concatenates. Each
    call's text is decoded once, when a later call first looks.
    """
    if session is None:
        return [], ""
    texts = session.call_texts
    for it in session.interactions[len(texts) :]:
        texts.append(tokenizer.decode(it.prompt_ids + it.output_ids))
    for it, known in zip(reversed(session.interactions), reversed(texts), strict=True):
        if text.startswith(known):
            return it.prompt_ids + it.output_ids, known
    return [], ""
