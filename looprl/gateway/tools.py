"""OpenAI tool calling on top of a chat template: rendering tools in, parsing calls out.

Owns: how `tools`, assistant `tool_calls` and `role: tool` messages reach the chat
template, the text that forces a call (`tool_choice`), and parsing the model's tool
calls out of its sampled text. Does not own HTTP (app.py) or sampling (the engine).

Rendering. A template that mentions `tools` renders them itself (Qwen, Llama 3.1,
Hermes templates): it gets `tools=` and messages in Hugging Face's tool format. Any
other template (SmolLM2's, for one) gets this documented format, the Hermes one:
- the tools go into the system prompt, after the conversation's own system message if
  there is one (`TOOLS_PROMPT` below: one JSON schema per line inside `<tools>`);
- an assistant message's calls are written after its content, one per call:
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- a `role: tool` message becomes a user turn `<tool_response>\\n...\\n</tool_response>`.
An assistant message whose calls this session returned is rendered as the exact text
the model sampled, so the next prompt extends the tokens already sampled and the
session's calls concatenate into one training sample.

Parsing. Every `<tool_call>...</tool_call>` span (the last one may lack its closing
tag) must hold a JSON object `{"name", "arguments"}` (`parameters` is read as
`arguments`, as Llama 3 writes it) or a list of them, naming a declared tool with
object arguments. Anything else is not a call: the whole text comes back as content,
with the reason, and the gateway counts it.

`tool_choice`: `none` leaves tools out and parses nothing; `auto` (the default with
tools) lets the model choose; `required` and a named function are forced by appending
the start of a call to the prompt (`<tool_call>\\n` or up to `"arguments": `), whose
tokens are prompt, not sampled: they are not trained on.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from looprl.gateway.limits import loads_bounded, lone_surrogate

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

TOOLS_PROMPT = """\
You can call functions. Their JSON schemas:
<tools>
{schemas}
</tools>
To call a function, answer with
<tool_call>
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
</tool_call>
Function results come back in <tool_response></tool_response>."""

_CALL_SPAN = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template handles `tools` itself (it refers to the variable)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def format_call(name: str, arguments: dict[str, Any]) -> str:
    """One call in the documented format."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def forced_prefix(tool_choice: str | dict | None) -> str:
    """Text appended to the prompt to force a call (empty when nothing is forced)."""
    if tool_choice == "required":
        return f"{TOOL_CALL_OPEN}\n"
    if isinstance(tool_choice, dict):
        name = json.dumps(tool_choice["function"]["name"], ensure_ascii=False)
        return f'{TOOL_CALL_OPEN}\n{{"name": {name}, "arguments": {{'
    return ""


def render_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    native: bool,
    sampled_texts: dict[str, str],
) -> list[dict[str, Any]]:
    """Messages ready for `apply_chat_template` (with `tools=` too when `native`).

    `messages` are OpenAI chat messages with text content. `sampled_texts` maps the id
    of a tool call this session returned to the full text the model sampled for it.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        role, calls = message["role"], message.get("tool_calls") or []
        sampled = next((sampled_texts[c["id"]] for c in calls if c["id"] in sampled_texts), None)
        if sampled is not None:
            out.append({"role": "assistant", "content": sampled})
        elif calls and native:
            hf_calls = [
                {"type": "function", "function": {"name": c["function"]["name"], "arguments": a}}
                for c, a in zip(calls, _arguments(calls), strict=True)
            ]
            out.append({"role": "assistant", "content": message["content"], "tool_calls": hf_calls})
        elif calls:
            written = [
                format_call(c["function"]["name"], a)
                for c, a in zip(calls, _arguments(calls), strict=True)
            ]
            content = "\n".join(filter(None, [message["content"], *written]))
            out.append({"role": "assistant", "content": content})
        elif role == "tool" and not native:
            content = f"<tool_response>\n{message['content']}\n</tool_response>"
            out.append({"role": "user", "content": content})
        else:
            out.append({k: v for k, v in message.items() if k != "tool_calls"})
    if tools and not native:
        schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = TOOLS_PROMPT.format(schemas=schemas)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments(calls: list[dict[str, Any]]) -> list[Any]:
    """Each call's arguments as JSON values (OpenAI sends them as a JSON string); the
    string itself where it is not JSON, or is JSON escaping a lone surrogate (which no
    template output could be tokenized with)."""
    out = []
    for call in calls:
        arguments = call["function"]["arguments"]
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            out.append(arguments)
            continue
        surrogate = "\\u" in arguments and lone_surrogate(value) is not None
        out.append(arguments if surrogate else value)
    return out


@dataclass
class ParsedOutput:
    """A choice's text split into content and OpenAI tool calls.

    `error` says why text that looked like a call was not one (then `tool_calls` is
    empty and `content` is the whole text).
    """

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


def parse_tool_calls(
    text: str, tool_names: set[str], parallel: bool = True, max_json_depth: int = 64
) -> ParsedOutput:
    """Parse the calls in `text`; `parallel=False` keeps only the first. A call nesting
    JSON deeper than `max_json_depth` is not parsed (an error, like invalid JSON)."""
    spans = list(_CALL_SPAN.finditer(text))
    if not spans:
        return ParsedOutput(content=text)
    calls: list[dict[str, Any]] = []
    for span in spans:
        body = span.group(1).strip()
        try:
            value = loads_bounded(body, max_json_depth)
        except ValueError as e:  # json.JSONDecodeError is one
            return ParsedOutput(text, error=f"a tool call is not valid JSON ({e}): {body[:80]!r}")
        for item in value if isinstance(value, list) else [value]:
            call, error = _call(item, tool_names, max_json_depth)
            if error:
                return ParsedOutput(text, error=error)
            calls.append(call)
    if not calls:
        return ParsedOutput(text, error="a <tool_call> holds an empty list")
    content = _CALL_SPAN.sub("", text).strip() or None
    return ParsedOutput(content, calls if parallel else calls[:1])


def _call(
    item: Any, tool_names: set[str], max_json_depth: int
) -> tuple[dict[str, Any], str | None]:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return {}, f'a tool call must be an object with a string "name", got {item!r:.80}'
    name = item["name"]
    if name not in tool_names:
        known = ", ".join(sorted(tool_names))
        return {}, f"the model called {name!r}, which is not among the tools ({known})"
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = loads_bounded(arguments, max_json_depth)
        except ValueError:  # json.JSONDecodeError is one
            return {}, f"the arguments of {name!r} are a string that is not JSON"
    if not isinstance(arguments, dict):
        return {}, f"the arguments of {name!r} must be a JSON object, got {arguments!r:.80}"
    call = {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }
    return call, None
