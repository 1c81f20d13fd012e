"""OpenAI tool calling through the gateway over real HTTP, with the real `openai` client.

The tool model (tests/support/tool_model.py: a tiny model fine-tuned to call `add`, greedy)
samples real tool calls; the random tiny model samples text that never parses. The
round trip checks what concatenation depends on: the second call's prompt starts with
the first call's prompt and sampled tokens, exactly.
"""

from __future__ import annotations

import json

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError

from examples.calculator.tools import TOOLS
from looprl.models import load_model, load_tokenizer
from looprl.rollout.trajectory import build_trajectories
from looprl.types import Interaction
from tests.support.local_gateway import greedy_gateway
from tests.support.tool_model import ANSWER, CALL

ADD_TWO = {**TOOLS[0], "function": {**TOOLS[0]["function"], "name": "add two"}}
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def tokenizer(tool_model_dir):
    return load_tokenizer(tool_model_dir)


def _client(handle) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=handle.base_url, api_key=handle.api_key, max_retries=0)


async def test_a_sampled_call_goes_round_trip_and_the_session_concatenates(
    tool_model_dir, tokenizer
):
    async with greedy_gateway(tool_model_dir) as server:
        handle = server.open_session()
        async with _client(handle) as client:
            first = await client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS)
            choice = first.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            (call,) = choice.message.tool_calls
            assert call.function.name == "add"
            assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
            # the agent sends back the message as the client parsed it, then the result
            messages = [
                *QUESTION,
                choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "5"},
            ]
            second = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        assert second.choices[0].message.content == ANSWER
        assert second.choices[0].finish_reason == "stop"
        sampled = first.prompt_token_ids + choice.token_ids
        assert second.prompt_token_ids[: len(sampled)] == sampled
        between = tokenizer.decode(second.prompt_token_ids[len(sampled) :])
        assert between.startswith("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>")
        session = server.close_session(handle.id)
    (sample,), stats, breaks = build_trajectories(session.interactions, 1.0, "concat")
    assert breaks == [] and stats["calls"] == 2
    assert tokenizer.decode(sample.input_ids[sample.loss_mask]) == (
        f"{CALL}<|im_end|>{ANSWER}<|im_end|>"
    )


async def test_streamed_tool_calls_arrive_in_one_delta_with_finish_reason(tool_model_dir):
    async with greedy_gateway(tool_model_dir) as server:
        handle = server.open_session()
        async with _client(handle) as client:
            stream = await client.chat.completions.create(
                model="m", messages=QUESTION, tools=TOOLS, stream=True
            )
            chunks = [c async for c in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    (with_calls,) = [d for d in deltas if d.tool_calls]
    (call,) = with_calls.tool_calls
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


async def test_tool_choice_none_renders_no_tools_and_parses_nothing(tool_model_dir, tokenizer):
    async with greedy_gateway(tool_model_dir) as server:
        handle = server.open_session()
        async with _client(handle) as client:
            response = await client.chat.completions.create(
                model="m", messages=QUESTION, tools=TOOLS, tool_choice="none"
            )
    assert "<tools>" not in tokenizer.decode(response.prompt_token_ids)
    assert response.choices[0].message.tool_calls is None


async def test_forced_calls_that_do_not_parse_are_content_counted_never_an_error(
    tiny_model_dir,
):
    tokenizer = load_tokenizer(tiny_model_dir)
    async with greedy_gateway(tiny_model_dir) as server:
        handle = server.open_session()
        async with _client(handle) as client:
            required = await client.chat.completions.create(
                model="m", messages=QUESTION, tools=TOOLS, tool_choice="required", n=2
            )
            named = await client.chat.completions.create(
                model="m",
                messages=QUESTION,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "multiply"}},
            )
        prompt = tokenizer.decode(named.prompt_token_ids)
        assert prompt.endswith(
            '<|im_start|>assistant\n<tool_call>\n{"name": "multiply", "arguments": {'
        )
        for choice in [*required.choices, *named.choices]:
            assert choice.message.tool_calls is None and choice.finish_reason == "length"
            assert choice.message.content.startswith("<tool_call>\n")  # the forced start too
        assert server.store.get(handle.id).tool_call_errors == 3
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{server.url}/health")).json()["tool_call_errors"] == 3
        # the forced start is prompt: only the sampled tokens are trained on
        session = server.close_session(handle.id)
        (sample, *_), _, _ = build_trajectories(session.interactions, 1.0, "per_call")
        assert sample.num_sampled_tokens == len(required.choices[0].token_ids)


async def test_bad_tool_requests_are_400_naming_the_problem(tiny_model_dir):
    bad = {
        "tool_choice names no tool": (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sub"}}},
            "'sub', which is not among the tools (add, multiply)",
        ),
        "tool_choice without tools": ({"tool_choice": "required"}, "needs tools"),
        "tool message without its call id": (
            {"messages": [*QUESTION, {"role": "tool", "content": "5"}]},
            "messages[1].tool_call_id: Field required",
        ),
        "a tool name OpenAI refuses": (
            {"tools": [ADD_TWO]},
            "tools[0].function.name",
        ),
    }
    async with greedy_gateway(tiny_model_dir) as server:
        handle = server.open_session()
        async with _client(handle) as client:
            for case, (fields, message) in bad.items():
                with pytest.raises(BadRequestError) as error:
                    await client.chat.completions.create(
                        model="m", **{"messages": QUESTION, **fields}
                    )
                assert message in error.value.message, case


NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};"
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def test_a_template_that_renders_tools_gets_them_in_hugging_face_form(
    tiny_model_dir, tmp_path
):
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = NATIVE_TEMPLATE
    model_dir = tmp_path / "native-model"
    load_model(tiny_model_dir).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_from_elsewhere",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_from_elsewhere", "content": "5"},
    ]
    async with greedy_gateway(model_dir) as server:
        handle = server.open_session()
        async with _client(handle) as client:
            response = await client.chat.completions.create(
                model="m", messages=history, tools=TOOLS, max_tokens=1
            )
    prompt = tokenizer.decode(response.prompt_token_ids)
    assert prompt == (
        "<|im_start|>system\nTOOLS:add;multiply;<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        '<|im_start|>assistant\nCALL add {"a": 2, "b": 3}<|im_end|>\n'
        "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    )


async def test_a_prompt_reuses_the_ids_sampled_when_re_tokenizing_would_split_otherwise(
    tiny_model_dir,
):
    tokenizer = load_tokenizer(tiny_model_dir)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt.input_ids if hasattr(prompt, "input_ids") else prompt)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    # " answer" is one token; the model could as well have sampled " ans" + "wer"
    sampled = [*encode("The"), *encode(" ans"), *encode("wer"), *encode(" is 5.")]
    assert sampled != encode("The answer is 5.")
    sampled.append(tokenizer.eos_token_id)
    history = [
        *QUESTION,
        {"role": "assistant", "content": "The answer is 5."},
        {"role": "user", "content": "Again?"},
    ]
    async with greedy_gateway(tiny_model_dir) as server:
        handle = server.open_session()
        session = server.store.get(handle.id)
        session.interactions.append(
            Interaction(
                "chatcmpl-0", prompt, sampled, [0.0] * len(sampled), [0] * len(sampled), "stop"
            )
        )
        async with _client(handle) as client:
            again = await client.chat.completions.create(model="m", messages=history, max_tokens=1)
            elsewhere = await client.chat.completions.create(
                model="m", messages=[{"role": "system", "content": "Hi."}, *history], max_tokens=1
            )
    assert again.prompt_token_ids[: len(prompt) + len(sampled)] == prompt + sampled
    assert tokenizer.decode(again.prompt_token_ids).endswith(
        "Again?<|im_end|>\n<|im_start|>assistant\n"
    )
    # a prompt that does not start with the session's text is tokenized afresh
    assert encode("The answer is 5.")[1] in elsewhere.prompt_token_ids
