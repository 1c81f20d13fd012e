"""Prompt token ids from a request.

Owns: the chat prompt (messages and tools through the model's chat template, then the
forced start of a tool call; within a session, an earlier call's exact token ids where
the new prompt's text starts with that call's), tokenizing text, and refusing a prompt
that cannot fit the model's context from its length in characters, before tokenizing
it. Does not own how tools and tool-call messages are rendered (tools.py), what a
prompt may hold (limits.py), nor where this runs (prompt_lanes.py: worker threads; so
everything here may run beside the event loop, and takes the session's `prompt_lock`
where it writes to the session).

Why a prompt can be refused by its characters: no token covers more characters than
the longest string in the vocabulary (`max_token_chars`; in a byte-level vocabulary,
as Llama's, SmolLM's or Qwen's, one character per byte, and a character is at least a
byte), so a text of C characters is at least C / max_token_chars tokens. Beyond
`max_model_len x max_token_chars` characters it cannot fit, and tokenizing it (seconds
for megabytes) would only find that out. A tokenizer that normalizes text (NFC, say)
is measured on the normalized text.
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
    max_chars: int | None,
) -> tuple[list[int], list[dict], str]:
    """`req`'s prompt ids (`chat_prompt`), the tools the model sees, and the forced start
    of a tool call the prompt ends with ("" when `tool_choice` forces none)."""
    tools, tool_choice = req.active_tools()
    prefix = tools_lib.forced_prefix(tool_choice)
    ids = chat_prompt(
        tokenizer, req, tools, prefix, session, native_tools=native_tools, max_chars=max_chars
    )
    return ids, tools, prefix


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    req: ChatRequest,
    tools: list[dict],
    prefix: str,
    session: Session | None,
    *,
    native_tools: bool,
    max_chars: int | None = None,
) -> list[int]:
    """Prompt token ids: the messages (and tools) through the chat template, then the
    forced start of a tool call if any; where the text starts with an earlier call's,
    that call's exact ids. Raises APIError 400 when the template refuses, or when the
    text is over `max_chars` (`max_prompt_chars`; None: any length).

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
    check_length(tokenizer, text, max_chars, "messages")
    known_ids, known_text = _sampled_prefix(tokenizer, text, session)
    rest = text[len(known_text) :]
    return known_ids + tokenize(tokenizer, rest, add_special_tokens=False)


def tokenize(tokenizer: PreTrainedTokenizerBase, text: str, **kwargs: Any) -> list[int]:
    """Token ids of `text` (Unicode: the gateway refuses lone surrogates at the edge,
    limits.py). Releases the GIL while it encodes (`tokenizer(...)` encodes as a batch;
    the tokenizer's single `encode` holds it)."""
    return list(tokenizer(text, **kwargs).input_ids)


def max_prompt_chars(tokenizer: PreTrainedTokenizerBase, max_model_len: int | None) -> int | None:
    """The most characters a prompt of `max_model_len` tokens can have (the module's
    docstring says why); None when the context is not known."""
    if max_model_len is None:
        return None
    return max_model_len * max(len(token) for token in tokenizer.get_vocab())


def check_length(
    tokenizer: PreTrainedTokenizerBase, text: str, max_chars: int | None, field: str
) -> None:
    """A 400 naming `field` when `text` is over `max_chars` characters (normalized as the
    tokenizer does first): more tokens than the model's context holds."""
    if max_chars is None or len(text) <= max_chars:
        return
    normalizer = tokenizer.backend_tokenizer.normalizer
    chars = len(normalizer.normalize_str(text)) if normalizer is not None else len(text)
    if chars > max_chars:
        raise APIError(
            400,
            f"{field}: the prompt is {chars} characters, more than the model's context "
            f"can hold as tokens ({max_chars}: max_model_len x the longest token's "
            "characters); shorten it",
            field,
        )


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
    with session.prompt_lock:  # another call of the session may be decoding them too
        interactions = session.interactions[:]  # the loop may record more meanwhile
        texts = session.call_texts
        for it in interactions[len(texts) :]:
            texts.append(tokenizer.decode(it.prompt_ids + it.output_ids))
        texts = texts[: len(interactions)]
    for it, known in zip(reversed(interactions), reversed(texts), strict=True):
        if text.startswith(known):
            return it.prompt_ids + it.output_ids, known
    return [], ""
