"""Schema-driven fuzzing of the gateway: every operation of its OpenAPI schema, with
bodies schemathesis generates from it (valid ones, and invalid ones), against a real
gateway and engine on loopback, while a well-formed agent keeps calling beside it.

Asserted for every case: no 5xx, the status is one the schema documents, and the body
conforms to the documented response schema. The bystander's calls all complete with
the tokens they asked for. `make test` runs LOOPRL_FUZZ_EXAMPLES cases per operation
and mode (default 25); `make fuzz` runs many more and prints the total last.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from openai import OpenAI
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from looprl.config import LimitsConfig, SamplingConfig
from looprl.gateway import errors
from looprl.gateway.schemas import AnthropicMessage, ChatCompletion, ResponseObject
from looprl.models import load_model, load_tokenizer
from tests.support.local_gateway import ThreadedGateway

EXAMPLES = int(os.environ.get("LOOPRL_FUZZ_EXAMPLES", "25"))
REPORT = os.environ.get("LOOPRL_FUZZ_REPORT")  # a file the case counts are appended to
# Small enough that every generated request is served in milliseconds.
LIMITS = LimitsConfig(max_request_bytes=256 * 1024, request_token_budget=64)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
OPERATIONS = [
    "POST /sessions/{session_id}/v1/chat/completions",
    "POST /sessions/{session_id}/v1/completions",
    "POST /sessions/{session_id}/v1/responses",
    "POST /sessions/{session_id}/v1/messages",
    "POST /sessions/{session_id}/v1/messages/count_tokens",
    "GET /sessions/{session_id}/v1/models",
    "POST /sessions/{session_id}/reward",
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/responses",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "GET /v1/models",
    "GET /health",
]
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]  # valid bodies, then invalid

pytestmark = pytest.mark.timeout(max(300, EXAMPLES * 8))


@pytest.fixture(scope="module")
def gateway(tiny_model_dir):
    gateway = ThreadedGateway(
        load_model(tiny_model_dir),
        load_tokenizer(tiny_model_dir),
        model_name="tiny",
        sessionless=True,
        default_sampling=SamplingConfig(max_new_tokens=8),
        limits=LIMITS,
    )
    yield gateway
    gateway.close()


@pytest.fixture(scope="module")
def schema(gateway):
    return schemathesis.openapi.from_url(f"{gateway.server.url}/openapi.json")


class Bystander:
    """A well-formed agent calling the gateway in a loop on its own session."""

    def __init__(self, gateway: ThreadedGateway) -> None:
        handle = gateway.call(lambda server: server.open_session())
        self.client = OpenAI(base_url=handle.base_url, api_key=handle.api_key, max_retries=0)
        self.calls, self.errors = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                response = self.client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "What is 2 + 3?"}],
                    max_tokens=4,
                    seed=self.calls,
                    timeout=60,
                )
                choice = response.choices[0]
                if choice.finish_reason == "length" and len(choice.token_ids) != 4:
                    self.errors.append(f"asked for 4 tokens, got {len(choice.token_ids)}")
                self.calls += 1
            except Exception as e:  # every failure is a finding: report them all
                self.errors.append(repr(e))
                self.calls += 1

    def __enter__(self) -> Bystander:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        self.client.close()


@pytest.mark.parametrize(
    ("label", "mode"),
    [
        (label, mode)
        for label in OPERATIONS
        for mode in MODES  # a GET has no body, and its path and key are fixed here
        if label.startswith("POST") or mode == GenerationMode.POSITIVE
    ],
    ids=str,
)
def test_fuzz_operation(gateway, schema, label, mode):
    operation = schema.find_operation_by_label(label)
    handle = gateway.call(lambda server: server.open_session())
    path = {"session_id": handle.id} if "{session_id}" in label else None
    key = handle.reward_key if label.endswith("/reward") else handle.api_key
    auth = {"Authorization": f"Bearer {key}"}
    statuses: Counter[int] = Counter()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=False,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(mode, path_parameters=path, headers=auth))
    def fuzz(case):
        response = case.call(base_url=gateway.server.url, timeout=60)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=CHECKS)

    with Bystander(gateway) as bystander:
        fuzz()
    assert bystander.errors == [], bystander.errors[:5]
    assert bystander.calls > 0
    assert not any(status >= 500 for status in statuses), statuses
    _report(f"{label} ({mode.value})", statuses)


# ---- hypothesis strategies for what agents send: chat messages and tool calls ----------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
# Arguments as agents send them: JSON objects, other JSON, text that is not JSON, and
# JSON nested deeper than the limit.
ARGUMENTS = st.one_of(
    JSON_VALUES.map(json.dumps),
    st.text(),
    st.integers(1, 200).map(lambda depth: "[" * depth + "]" * depth),
    st.integers(1, 200).map(lambda depth: '{"a": ' * depth + "1" + "}" * depth),
)
# Text with what tokenizers and templates trip on: lone surrogates, control characters,
# template syntax, the tool-call markup itself.
TEXT = st.one_of(
    st.text(),
    st.text(alphabet=st.characters(codec=None, categories=None)),
    st.sampled_from(["{{ x }}", "{% if %}", "<tool_call>", "</tool_call>", "<|im_end|>", "\ud800"]),
)


@st.composite
def tool_call(draw) -> dict:
    return {
        "id": draw(st.text(min_size=1, max_size=12)),
        "type": "function",
        "function": {"name": draw(st.text(max_size=12)), "arguments": draw(ARGUMENTS)},
    }


MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user"]), "content": TEXT}
    ),
    st.fixed_dictionaries(
        {"role": st.just("assistant")},
        optional={"content": st.none() | TEXT, "tool_calls": st.lists(tool_call(), max_size=3)},
    ),
    st.fixed_dictionaries(
        {"role": st.just("tool"), "content": TEXT, "tool_call_id": st.text(max_size=12)}
    ),
)
TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.from_regex(r"[A-Za-z0-9_-]{1,16}", fullmatch=True)},
            optional={"description": TEXT, "parameters": st.dictionaries(st.text(), JSON_VALUES)},
        ),
    }
)


def _surrogate_safe_json(body: dict) -> bytes:
    """JSON as a hostile client may send it: lone surrogates as \\u escapes."""
    return json.dumps(body, ensure_ascii=True).encode()


@pytest.mark.slow  # ~1,000 generated conversations: 70-120 s on 2 cores
def test_agent_shaped_requests_never_fail_the_server(gateway):
    """Conversations with tool calls whose arguments are anything at all."""
    handle = gateway.call(lambda server: server.open_session())
    url = f"{handle.base_url}/chat/completions"
    headers = {"Authorization": f"Bearer {handle.api_key}", "Content-Type": "application/json"}
    statuses: Counter[int] = Counter()

    @settings(
        max_examples=EXAMPLES * 4,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        messages=st.lists(MESSAGE, min_size=1, max_size=6),
        tools=st.none() | st.lists(TOOL, min_size=1, max_size=3),
        tool_choice=st.sampled_from([None, "auto", "none", "required"]),
        max_tokens=st.integers(1, 8),
    )
    def fuzz(messages, tools, tool_choice, max_tokens):
        body = {"messages": messages, "max_tokens": max_tokens}
        if tools is not None:
            body["tools"] = tools
            if tool_choice is not None:
                body["tool_choice"] = tool_choice
        response = httpx.post(url, content=_surrogate_safe_json(body), headers=headers, timeout=60)
        statuses[response.status_code] += 1
        assert response.status_code in (200, 400), (response.status_code, response.text[:500])
        if response.status_code == 200:
            ChatCompletion.model_validate(response.json())
        else:
            assert response.json()["error"]["message"]

    with Bystander(gateway) as bystander:
        fuzz()
    assert bystander.errors == [], bystander.errors[:5]
    assert statuses[200] > 0, statuses  # the strategies reach the engine, not only the edge
    _report("agent-shaped chat conversations", statuses)


# ---- ... and over the Responses API and Anthropic's Messages API -----------------------

# A value of the wrong type where a field wants another: any JSON at all.
WRONG = JSON_VALUES.filter(lambda value: not isinstance(value, str))
CALL_ID = st.text(max_size=12)
INPUT_TEXT = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": TEXT}
)
RESPONSES_ITEM = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
            "content": TEXT | st.lists(INPUT_TEXT, max_size=3),
        },
        optional={"type": st.just("message")},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": CALL_ID,
            "name": st.text(max_size=12),
            "arguments": ARGUMENTS,
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": CALL_ID, "output": TEXT}
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "web_search_call"])}),
)
RESPONSES_TOOL = st.fixed_dictionaries(
    {"type": st.just("function"), "name": st.from_regex(r"[A-Za-z0-9_-]{1,16}", fullmatch=True)},
    optional={"description": TEXT, "parameters": st.dictionaries(st.text(), JSON_VALUES)},
)
ANTHROPIC_BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": CALL_ID,
            "name": st.text(max_size=12),
            "input": JSON_VALUES,  # an object, or any other JSON
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": CALL_ID},
        optional={
            "content": TEXT
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})),
            "is_error": st.booleans(),
        },
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "image"]), "thinking": TEXT}),
)
ANTHROPIC_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant"]),
        "content": TEXT | st.lists(ANTHROPIC_BLOCK, min_size=1, max_size=4),
    }
)
ANTHROPIC_TOOL = st.fixed_dictionaries(
    {
        "name": st.from_regex(r"[A-Za-z0-9_-]{1,16}", fullmatch=True),
        "input_schema": st.dictionaries(st.text(), JSON_VALUES),
    },
    optional={"description": TEXT},
)
# The last message the user's, as agents send (else most bodies are the prefill 400).
ANTHROPIC_MESSAGES = st.tuples(
    st.lists(ANTHROPIC_MESSAGE, max_size=5),
    st.fixed_dictionaries(
        {"role": st.just("user"), "content": ANTHROPIC_MESSAGE.map(lambda m: m["content"])}
    ),
).map(lambda pair: [*pair[0], pair[1]])


def _spoil(body: dict, data: st.DataObject) -> dict:
    """`body` with, sometimes, one of its fields (or one of a list field's members) set to
    a value of the wrong type, as a buggy agent sends."""
    if data.draw(st.integers(0, 3), label="spoil") != 0:
        return body
    field = data.draw(st.sampled_from(sorted(body)), label="field")
    value = body[field]
    if isinstance(value, list) and value:
        at = data.draw(st.integers(0, len(value) - 1), label="at")
        return {**body, field: [*value[:at], data.draw(WRONG, label="wrong"), *value[at + 1 :]]}
    return {**body, field: data.draw(WRONG, label="wrong")}


def _field_path(text: str) -> str:
    """The field path (`input[1].arguments`) `text` starts with; "" if none."""
    match = re.match(r"[A-Za-z_]+(?:\[\d+\]|\.[A-Za-z_]+)*", text)
    return match.group() if match else ""


def _fuzz_agent_api(gateway, route: str, bodies, check_answer, check_error, name: str) -> None:
    """POST what `bodies` draws to the session's `route`: each a 200 that `check_answer`
    takes (a JSON body, or a stream's events), or a 400 that `check_error(body, error)`."""
    handle = gateway.call(lambda server: server.open_session())
    url = f"{handle.base_url}/{route}"
    headers = {"Authorization": f"Bearer {handle.api_key}", "Content-Type": "application/json"}
    statuses: Counter[int] = Counter()

    @settings(
        max_examples=EXAMPLES * 2,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=bodies, data=st.data())
    def fuzz(body, data):
        body = _spoil(body, data)
        response = httpx.post(url, content=_surrogate_safe_json(body), headers=headers, timeout=60)
        statuses[response.status_code] += 1
        assert response.status_code in (200, 400), (response.status_code, response.text[:500])
        if response.status_code == 400:
            check_error(body, response.json())
        elif response.headers["content-type"].startswith("text/event-stream"):
            events = [_event(text) for text in response.text.strip().split("\n\n")]
            check_answer(events[-1]["response"] if route == "responses" else events)
        else:
            check_answer(response.json())

    with Bystander(gateway) as bystander:
        fuzz()
    assert bystander.errors == [], bystander.errors[:5]
    assert statuses[200] > 0, statuses  # the strategies reach the engine, not only the edge
    _report(name, statuses)


def _event(text: str) -> dict:
    """A named server-sent event's data; its name is the data's `type`."""
    name, data = text.split("\n")
    event = json.loads(data.removeprefix("data: "))
    assert name == f"event: {event['type']}", text
    return event


def _openai_error_names_the_field(body: dict, answer: dict) -> None:
    assert set(answer) == {"error"}, answer
    error = answer["error"]
    assert error["param"] is not None and error["message"], error
    assert _field_path(error["param"]) == error["param"], error
    assert re.split(r"[.\[]", error["param"])[0] in body, (error, sorted(body))


def _anthropic_error_names_the_field(body: dict, answer: dict) -> None:
    assert answer["type"] == "error" and set(answer) == {"type", "error"}, answer
    message = answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error", answer
    path = _field_path(message)
    assert message.startswith(f"{path}:"), message
    assert re.split(r"[.\[]", path)[0] in body, (message, sorted(body))


def _anthropic_answer(answer: dict | list[dict]) -> None:
    if isinstance(answer, list):  # the stream: start, blocks, delta, stop
        assert answer[0]["type"] == "message_start" and answer[-1]["type"] == "message_stop"
        return
    AnthropicMessage.model_validate(answer)


def test_agent_shaped_responses_requests_never_fail_the_server(gateway):
    """Responses conversations: function calls and their outputs, arguments that are
    anything at all, items and tools the gateway does not take, fields of the wrong type."""
    bodies = st.fixed_dictionaries(
        {
            "input": TEXT | st.lists(RESPONSES_ITEM, min_size=1, max_size=6),
            "max_output_tokens": st.integers(1, 8),
        },
        optional={
            "instructions": TEXT,
            "tools": st.lists(RESPONSES_TOOL, min_size=1, max_size=3),
            "tool_choice": st.sampled_from(["auto", "none", "required"]),
            "stream": st.booleans(),
        },
    )
    _fuzz_agent_api(
        gateway,
        "responses",
        bodies,
        ResponseObject.model_validate,
        _openai_error_names_the_field,
        "agent-shaped Responses conversations",
    )


def test_agent_shaped_messages_requests_never_fail_the_server(gateway):
    """Messages conversations: tool_use blocks whose input is any JSON, tool_result
    blocks, blocks the gateway does not take, fields of the wrong type."""
    bodies = st.fixed_dictionaries(
        {
            "model": st.just("m"),
            "messages": ANTHROPIC_MESSAGES,
            "max_tokens": st.integers(1, 8),
        },
        optional={
            "system": TEXT,
            "tools": st.lists(ANTHROPIC_TOOL, min_size=1, max_size=3),
            "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}]),
            "stop_sequences": st.lists(TEXT, max_size=2),
            "stream": st.booleans(),
        },
    )
    _fuzz_agent_api(
        gateway,
        "messages",
        bodies,
        _anthropic_answer,
        _anthropic_error_names_the_field,
        "agent-shaped Messages conversations",
    )


def _report(name: str, statuses: Counter[int]) -> None:
    """One JSON line per test in LOOPRL_FUZZ_REPORT, summed by `make fuzz`."""
    if REPORT:
        line = {"name": name, "cases": sum(statuses.values()), "statuses": statuses}
        with Path(REPORT).open("a") as f:
            f.write(json.dumps(line) + "\n")


# ---- lone surrogates in any string, and huge bodies, on every route ---------------------

# One body per route with every string field the route takes, each a place to spoil.
ARGUMENTS_JSON = json.dumps({"a": "1"})
TOOL_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "description": "x"}}}
CHAT_BODY = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "u"}]},
        {
            "role": "assistant",
            "content": "a",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {"name": "add", "description": "d", "parameters": TOOL_SCHEMA},
        }
    ],
    "stop": ["x"],
    "max_tokens": 2,
}
RESPONSES_BODY = {
    "model": "m",
    "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": ARGUMENTS_JSON},
        {"type": "function_call_output", "call_id": "c1", "output": "2"},
    ],
    "instructions": "i",
    "tools": [{"type": "function", "name": "add", "description": "d", "parameters": TOOL_SCHEMA}],
    "metadata": {"k": "v"},
    "include": ["message.output_text.logprobs"],
    "stop": ["x"],
    "max_output_tokens": 2,
}
COUNT_BODY = {
    "model": "m",
    "system": [{"type": "text", "text": "s"}],
    "messages": [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": "1"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "2"}]},
    ],
    "tools": [{"name": "add", "description": "d", "input_schema": TOOL_SCHEMA}],
}
MESSAGES_BODY = {
    **COUNT_BODY,
    "stop_sequences": ["x"],
    "metadata": {"user_id": "u"},
    "max_tokens": 2,
}
ROUTE_BODIES = {
    "chat/completions": CHAT_BODY,
    "completions": {"model": "m", "prompt": "p", "stop": ["x"], "max_tokens": 2},
    "responses": RESPONSES_BODY,
    "messages": MESSAGES_BODY,
    "messages/count_tokens": COUNT_BODY,
    "reward": {"completion_id": "c", "reward": 1.0},
}
SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])


def _strings(value, path=()) -> list[tuple[tuple, bool]]:
    """Where `value` holds strings: (path, is a key) for each value and each key."""
    if isinstance(value, str):
        return [(path, False)]
    if isinstance(value, list):
        return [s for i, v in enumerate(value) for s in _strings(v, (*path, i))]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [((*path, k), True), *_strings(v, (*path, k))]]
    return []


def _edit(value, path: tuple, is_key: bool, edit):
    """`value` with the string (or key) at `path` replaced by `edit(string)`."""
    if not path:
        return edit(value)
    head, rest = path[0], path[1:]
    if isinstance(value, list):
        return [_edit(v, rest, is_key, edit) if i == head else v for i, v in enumerate(value)]
    if is_key and not rest:
        return {(edit(k) if k == head else k): v for k, v in value.items()}
    return {k: _edit(v, rest, is_key, edit) if k == head else v for k, v in value.items()}


def _post(gateway, handle, route: str, content: bytes) -> httpx.Response:
    key = handle.reward_key if route == "reward" else handle.api_key
    root = handle.base_url.removesuffix("/v1") if route == "reward" else handle.base_url
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(f"{root}/{route}", content=content, headers=headers, timeout=60)


@pytest.mark.parametrize("route", sorted(ROUTE_BODIES))
def test_a_lone_surrogate_in_any_string_is_a_400_naming_its_field(gateway, route):
    """Issue 51: "\\ud800" in the Responses API's `metadata` gave a 500 after the call was
    generated and recorded. A lone surrogate in any value or key of any route's body,
    streamed or not, is a 400 naming the field, before any work; one escaped inside a
    JSON string (tool-call arguments) is text like any other."""
    handle = gateway.call(lambda server: server.open_session())
    body = ROUTE_BODIES[route]
    places = _strings(body)
    statuses: Counter[int] = Counter()

    @settings(max_examples=EXAMPLES * 2, deadline=None, database=None)
    @given(
        at=st.integers(0, len(places) - 1),
        surrogate=SURROGATES,
        where=st.integers(0, 3),
        escaped=st.booleans(),
        stream=st.booleans(),
    )
    def fuzz(at, surrogate, where, escaped, stream):
        path, is_key = places[at]
        if escaped:  # JSON text inside a string holding "\\ud800": valid Unicode
            surrogate = json.dumps(surrogate)[1:-1]
        spoiled = _edit(body, path, is_key, lambda s: s[:where] + surrogate + s[where:])
        if stream and route not in ("reward", "messages/count_tokens"):
            spoiled = {**spoiled, "stream": True}
        response = _post(gateway, handle, route, _surrogate_safe_json(spoiled))
        statuses[response.status_code] += 1
        if escaped:
            assert response.status_code in (200, 400), (response.status_code, response.text[:300])
            return
        assert response.status_code == 400, (path, response.status_code, response.text[:300])
        answer = response.json()
        if errors.anthropic_route(f"/v1/{route}"):
            message = answer["error"]["message"]
        else:
            message, param = answer["error"]["message"], answer["error"]["param"]
            assert param is None or message.startswith(f"{param}:"), answer
        assert "lone surrogate" in message, answer
        named = [p for p in path[: len(path) - is_key] if isinstance(p, str)]
        assert message.startswith(named[0] if named else "the request body"), (path, message)

    fuzz()
    assert not any(status >= 500 for status in statuses), statuses
    _report(f"lone surrogates in {route}", statuses)


@pytest.mark.parametrize("route", sorted(ROUTE_BODIES))
def test_huge_strings_in_any_field_are_answered_without_a_server_error(gateway, route):
    """A string as large as the body limit allows in any field: a 200, a 400 (too long for
    the context, a limit) or a 413 (over the body limit), never a 5xx."""
    handle = gateway.call(lambda server: server.open_session())
    body = ROUTE_BODIES[route]
    places = [place for place in _strings(body) if not place[1]]
    statuses: Counter[int] = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, database=None)
    @given(
        at=st.integers(0, len(places) - 1),
        size=st.sampled_from([LIMITS.max_request_bytes - 2048, LIMITS.max_request_bytes + 1]),
        filler=st.sampled_from(["a", "é", "😀", " ", "[", "\\", '"']),
    )
    def fuzz(at, size, filler):
        path, _ = places[at]
        grown = _edit(body, path, False, lambda s: s + filler * (size // len(filler.encode())))
        content = json.dumps(grown, ensure_ascii=False).encode()
        response = _post(gateway, handle, route, content)
        statuses[response.status_code] += 1
        assert response.status_code in (200, 400, 413), (path, response.text[:300])
        if len(content) > LIMITS.max_request_bytes:
            assert response.status_code == 413, (path, len(content))

    fuzz()
    _report(f"huge strings in {route}", statuses)
