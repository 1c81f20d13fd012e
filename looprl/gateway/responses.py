"""OpenAI response bodies built from engine Generations.

Owns: what a call's JSON response and its server-sent events look like: the call's
identity and usage (Call), each choice of a chat or text completion (whole, or as
stream chunks), logprob objects in OpenAI's two formats, and SSE encoding. Does not
own what a choice says (app.py decodes, cuts at stop strings and parses tool calls)
nor when anything is sent.

Logprobs are floored at MIN_LOGPROB, as OpenAI reports impossible tokens (JSON has no
-inf); each token is its own id decoded alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from looprl.types import Generation, SamplingParams

MIN_LOGPROB = -9999.0  # what OpenAI reports for impossible tokens; JSON has no -inf
SSE_DONE = "data: [DONE]\n\n"  # the last event of every stream that was not cut short


@dataclass
class Call:
    """One request's identity: its id, OpenAI object types and prompt; and what its
    recorded Interactions keep: the chat messages, each choice's parsed tool calls (by
    choice index, filled as choices are answered), the arrival time and the token limit
    (what the request asked for, and what it ran under)."""

    id: str
    object: str
    chunk_object: str
    prompt_ids: list[int]
    messages: list[dict] | None = None
    tool_calls: dict[int, list[dict]] = field(default_factory=dict)
    started_s: float = field(default_factory=time.time)
    created: int = field(default_factory=lambda: int(time.time()))
    max_tokens: int | None = None  # the token limit its choices ran under
    requested_max_tokens: int | None = None  # the request's max_tokens; None: not given

    def header(self, model: str, chunk: bool = False) -> dict[str, Any]:
        kind = self.chunk_object if chunk else self.object
        return {"id": self.id, "object": kind, "created": self.created, "model": model}

    def usage(self, gens: list[Generation]) -> dict[str, int]:
        completion = sum(len(g.output_ids) for g in gens)
        prompt = len(self.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def body(self, model: str, choices: list[dict], gens: list[Generation]) -> dict[str, Any]:
        """The whole (not streamed) response."""
        return {
            **self.header(model),
            "choices": choices,
            "usage": self.usage(gens),
            "prompt_token_ids": self.prompt_ids,
        }


@dataclass
class Plan:
    """A request as the chat path answers it: the call (id, prompt, what is recorded),
    one SamplingParams per choice, and `message(index, text, finish)` -> (the choice's
    assistant message, its finish reason)."""

    call: Call
    sampling: list[SamplingParams]
    message: Callable[[int, str, str], tuple[dict, str]]


# (choice index, its Generation, the text a client sees, finish reason) -> body parts
ChoiceFn = Callable[[int, Generation, str, str], dict]
ChunksFn = Callable[[int, Generation, str, str], list[dict]]


# ---- chat completions --------------------------------------------------------------


def chat_choice(
    index: int, gen: Generation, message: dict, finish: str, logprobs: dict | None
) -> dict:
    """One choice of a chat completion."""
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish,
        "token_ids": gen.output_ids,
    }


def chat_chunks(
    index: int, gen: Generation, delta: dict, finish: str, logprobs: dict | None
) -> list[dict]:
    """One chat choice streamed: its whole delta (tool calls indexed), then its end."""
    if "tool_calls" in delta:
        delta["tool_calls"] = [
            {"index": i, **tool_call} for i, tool_call in enumerate(delta["tool_calls"])
        ]
    return [
        {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": None,
            "token_ids": gen.output_ids,
        },
        {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish},
    ]


def chat_logprobs(tokenizer: PreTrainedTokenizerBase, gen: Generation) -> list[dict]:
    """A chat choice's `logprobs.content`: each token with its top alternatives."""
    tokens = token_strings(tokenizer, gen.output_ids)
    tops = gen.top_logprobs or [[] for _ in gen.output_ids]
    top_tokens = token_strings(tokenizer, [i for row in tops for i, _ in row])
    content, k = [], 0
    for token, logprob, row in zip(tokens, gen.logprobs, tops, strict=True):
        alternatives = []
        for _, top_logprob in row:
            alternatives.append(_token_logprob(top_tokens[k], top_logprob))
            k += 1
        content.append({**_token_logprob(token, logprob), "top_logprobs": alternatives})
    return content


# ---- text completions --------------------------------------------------------------


def completion_choice(
    index: int, gen: Generation, text: str, finish: str, logprobs: dict | None
) -> dict:
    """One choice of a text completion; a stream sends it whole as one chunk."""
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish,
        "token_ids": gen.output_ids,
    }


def completion_logprobs(tokenizer: PreTrainedTokenizerBase, gen: Generation) -> dict:
    """A text choice's `logprobs`, in the legacy completions format."""
    tokens = token_strings(tokenizer, gen.output_ids)
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top = None
    if gen.top_logprobs is not None:
        top = [
            {
                s: max(lp, MIN_LOGPROB)
                for s, (_, lp) in zip(
                    token_strings(tokenizer, [i for i, _ in row]), row, strict=True
                )
            }
            for row in gen.top_logprobs
        ]
    return {
        "tokens": tokens,
        "token_logprobs": [max(lp, MIN_LOGPROB) for lp in gen.logprobs],
        "top_logprobs": top,
        "text_offset": offsets,
    }


# ---- shared ------------------------------------------------------------------------


def token_strings(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    """Each token id decoded on its own."""
    return tokenizer.batch_decode([[i] for i in ids])


def sse(data: dict) -> str:
    """One server-sent event carrying `data` as JSON."""
    return f"data: {json.dumps(data)}\n\n"


def named_sse(data: dict) -> str:
    """One server-sent event named by the `type` of the JSON it carries, as the
    Responses and Anthropic Messages streams send them."""
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n"


def _token_logprob(token: str, logprob: float) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": max(logprob, MIN_LOGPROB),
        "bytes": list(token.encode("utf-8")),
    }
