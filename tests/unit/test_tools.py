import json

from looprl.gateway.limits import nesting_depth
from looprl.gateway.tools import (
    TOOLS_PROMPT,
    forced_prefix,
    format_call,
    parse_tool_calls,
    render_messages,
    template_renders_tools,
)

NAMES = {"add", "multiply"}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def test_a_hermes_call_is_parsed_with_json_string_arguments_and_the_text_kept_as_content():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    parsed = parse_tool_calls(text, NAMES)
    assert parsed.error is None
    assert parsed.content == "Let me add."
    (call,) = parsed.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}


def test_lists_several_spans_an_unclosed_last_span_and_llama_parameters():
    text = (
        '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "multiply", "parameters": {"a": 3, "b": 4}}]</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 5, \\"b\\": 6}"}'
    )
    parsed = parse_tool_calls(text, NAMES)
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [
        {"a": 1, "b": 2},
        {"a": 3, "b": 4},
        {"a": 5, "b": 6},
    ]
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["add", "multiply", "add"]
    assert parsed.content is None
    assert len({c["id"] for c in parsed.tool_calls}) == 3
    assert len(parse_tool_calls(text, NAMES, parallel=False).tool_calls) == 1


def test_text_without_a_call_is_content_and_no_error():
    parsed = parse_tool_calls("The answer is 5.", NAMES)
    assert (parsed.content, parsed.tool_calls, parsed.error) == ("The answer is 5.", [], None)


def test_unparseable_calls_come_back_whole_as_content_with_the_reason():
    cases = {
        '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>': "not valid JSON",
        '<tool_call>{"name": "divide", "arguments": {}}</tool_call>': "'divide', which is not",
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>': "must be a JSON object",
        '<tool_call>{"arguments": {}}</tool_call>': 'string "name"',
        "<tool_call>[]</tool_call>": "empty list",
    }
    for text, reason in cases.items():
        parsed = parse_tool_calls(f"Sure. {text}", NAMES)
        assert parsed.tool_calls == [] and parsed.content == f"Sure. {text}"
        assert reason in parsed.error, (text, parsed.error)


def test_tools_go_into_the_system_prompt_and_tool_results_into_user_turns():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 + 3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2}'},
                }
            ],
        },
        {"role": "tool", "content": "5", "tool_call_id": "c1"},
    ]
    out = render_messages(messages, [ADD], native=False, sampled_texts={})
    assert out[0] == {
        "role": "system",
        "content": "Be brief.\n\n" + TOOLS_PROMPT.format(schemas=json.dumps(ADD)),
    }
    assert out[2] == {"role": "assistant", "content": format_call("add", {"a": 2})}
    assert out[3] == {"role": "user", "content": "<tool_response>\n5\n</tool_response>"}
    # without a system message the tools make one; a call this session returned is
    # rendered as the text the model sampled, spacing and all
    sampled = {"c1": ' <tool_call>{"name":"add", "arguments":{"a":2}}</tool_call>'}
    out = render_messages(messages[1:], [ADD], native=False, sampled_texts=sampled)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("You can call functions")
    assert out[2] == {"role": "assistant", "content": sampled["c1"]}


def test_native_templates_get_hugging_face_tool_messages():
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    (out,) = render_messages(messages, [ADD], native=True, sampled_texts={})
    assert out["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}
    ]


def test_forced_prefixes_and_template_detection():
    assert forced_prefix("auto") == "" and forced_prefix(None) == ""
    assert forced_prefix("required") == "<tool_call>\n"
    named = forced_prefix({"type": "function", "function": {"name": "add"}})
    assert named == '<tool_call>\n{"name": "add", "arguments": {'
    assert template_renders_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_renders_tools("{{ message['content'] }}") and not template_renders_tools(
        None
    )


def test_a_call_nesting_thousands_deep_is_an_error_not_a_recursion():
    deep = "[" * 5000 + "]" * 5000
    parsed = parse_tool_calls(f"<tool_call>\n{deep}\n</tool_call>", {"f"}, max_json_depth=64)
    assert parsed.tool_calls == [] and parsed.content.startswith("<tool_call>")
    assert "deeper than 64" in parsed.error
    shallow = '<tool_call>{"name": "f", "arguments": {"a": [[1]]}}</tool_call>'
    assert parse_tool_calls(shallow, {"f"}, max_json_depth=4).tool_calls
    assert "deeper than 3" in parse_tool_calls(shallow, {"f"}, max_json_depth=3).error


def test_nesting_depth_ignores_brackets_inside_strings():
    assert nesting_depth('{"a": "[[[{{{", "b": [1, {"c": "\\"]]"}]}') == 3
    assert nesting_depth("[]") == 1 and nesting_depth("42") == 0
    assert nesting_depth(b"[" * 2000 + b"]" * 2000) == 2000


def test_nan_and_infinity_in_a_call_are_an_error_not_an_answer_no_one_can_write():
    for arguments in ('{"a": NaN, "b": 3}', '{"a": 2, "b": -Infinity}'):
        for body in (
            f'{{"name": "add", "arguments": {arguments}}}',
            f'{{"name": "add", "arguments": {json.dumps(arguments)}}}',  # as a JSON string
        ):
            text = f"<tool_call>\n{body}\n</tool_call>"
            out = parse_tool_calls(text, {"add"})
            assert out.tool_calls == [] and out.content == text and out.error, body
    deep = '"' + "[" * 100 + "]" * 100 + '"'  # arguments as a string nesting too deep
    out = parse_tool_calls(
        f'<tool_call>{{"name": "add", "arguments": {deep}}}</tool_call>', {"add"}
    )
    assert out.tool_calls == [] and "not JSON" in out.error
