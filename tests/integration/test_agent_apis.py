"""The Responses API and Anthropic's Messages API, over real HTTP with the real `openai`,
`anthropic` and `openai-agents` clients.

The tool model (tests/support/tool_model.py: a tiny model fine-tuned to call `add`,
greedy) samples real tool calls. What each API must keep: the call comes back in the
API's own shape (a `function_call` item, a `tool_use` block), the result goes back in
the API's own shape, and the next call's prompt extends the tokens sampled so far, so a
conversation is one sample whichever API carries it; the three-API test checks that the
samples are the same token for token.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
import torch
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI, BadRequestError

from examples.calculator.agent_anthropic import ANTHROPIC_TOOLS, CalculatorAnthropicAgent
from examples.calculator.agent_openai import CalculatorAgent
from examples.calculator.agent_responses import RESPONSES_TOOLS, CalculatorResponsesAgent
from examples.calculator.agent_sdk import CalculatorSDKAgent
from looprl import startup
from looprl.models import load_tokenizer
from looprl.rollout.trajectory import build_trajectories
from looprl.scheduling.single_process import start_single_process
from tests.support.local_gateway import greedy_gateway
from tests.support.tiny_run import train_tool_agent_two_steps
from tests.support.tool_model import ANSWER, CALL, assert_one_sample_round_trip, greedy_config

QUESTION = "What is 2 + 3?"
ROW = {"question": QUESTION, "answer": 5}


@pytest.fixture(scope="module")
def tokenizer(tool_model_dir):
    return load_tokenizer(tool_model_dir)


def _openai(handle) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=handle.base_url, api_key=handle.api_key, max_retries=0)


def _anthropic(handle, **auth) -> AsyncAnthropic:
    auth = auth or {"api_key": handle.api_key}
    root = handle.base_url.removesuffix("/v1")
    return AsyncAnthropic(base_url=root, max_retries=0, **auth)


def _function_call_output(call_id: str, output: str = "5") -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


# ---- the Responses API -------------------------------------------------------------


async def test_responses_round_trip_a_function_call_and_continue_by_previous_response_id(
    tool_model_dir, tokenizer
):
    async with greedy_gateway(tool_model_dir) as server:
        handle = server.open_session()
        async with _openai(handle) as client:
            first = await client.responses.create(model="m", input=QUESTION, tools=RESPONSES_TOOLS)
            assert first.status == "completed" and first.model == "calc"
            (call,) = first.output  # no text before the call: no message item
            assert call.type == "function_call" and call.name == "add"
            assert json.loads(call.arguments) == {"a": 2, "b": 3}
            assert call.call_id.startswith("call_") and call.id.startswith("fc_")
            sent_back = [item.model_dump(exclude_none=True) for item in first.output]
            items = [{"role": "user", "content": QUESTION}, *sent_back]
            second = await client.responses.create(
                model="m",
                input=[*items, _function_call_output(call.call_id)],
                tools=RESPONSES_TOOLS,
                include=["message.output_text.logprobs"],
            )
            # the same conversation carried by the server: the same prompt, exactly
            third = await client.responses.create(
                model="m",
                previous_response_id=first.id,
                input=[_function_call_output(call.call_id)],
                tools=RESPONSES_TOOLS,
            )
            with pytest.raises(BadRequestError, match="previous_response_id") as refused:
                await client.responses.create(model="m", previous_response_id="resp_x", input="hi")
        assert refused.value.body["param"] == "previous_response_id"
        session = server.close_session(handle.id)
    assert second.output_text == ANSWER and third.output_text == ANSWER
    assert third.prompt_token_ids == second.prompt_token_ids
    sampled = first.prompt_token_ids + first.output_token_ids
    assert second.prompt_token_ids[: len(sampled)] == sampled
    between = tokenizer.decode(second.prompt_token_ids[len(sampled) :])
    assert between.startswith("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>")
    (text,) = second.output[0].content
    assert [lp.token for lp in text.logprobs] == tokenizer.batch_decode(
        [[i] for i in second.output_token_ids]
    )
    assert second.usage.output_tokens == len(second.output_token_ids)
    # per-call rewards and the sample are keyed by the Responses API's own ids
    assert [it.completion_id for it in session.interactions] == [first.id, second.id, third.id]
    (sample,), _, breaks = build_trajectories(session.interactions[:2], 1.0, "concat")
    assert breaks == []
    assert tokenizer.decode(sample.input_ids[sample.loss_mask]) == (
        f"{CALL}<|im_end|>{ANSWER}<|im_end|>"
    )


async def test_responses_stream_the_events_of_the_whole_response(tool_model_dir):
    async with greedy_gateway(tool_model_dir) as server:
        handle = server.open_session()
        async with _openai(handle) as client:
            whole = await client.responses.create(model="m", input=QUESTION, tools=RESPONSES_TOOLS)
            stream = await client.responses.create(
                model="m", input=QUESTION, tools=RESPONSES_TOOLS, stream=True
            )
            events = [event async for event in stream]
            short = await client.responses.create(model="m", input=QUESTION, max_output_tokens=2)
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = events[-1].response
    assert json.loads(events[4].arguments) == {"a": 2, "b": 3}
    assert streamed.output[0].arguments == whole.output[0].arguments
    assert streamed.output_token_ids == whole.output_token_ids
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 2


async def test_responses_bad_requests_are_400_naming_the_item(tiny_model_dir):
    async with greedy_gateway(tiny_model_dir) as server:
        handle = server.open_session()
        async with _openai(handle) as client:
            cases = {
                "input[1].type": [
                    {"role": "user", "content": "hi"},
                    {"type": "reasoning", "summary": []},
                ],
                "input[0].content[0].type": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
                ],
                "input[0].call_id": [{"type": "function_call_output", "output": "5"}],
            }
            for param, items in cases.items():
                with pytest.raises(BadRequestError) as refused:
                    await client.responses.create(model="m", input=items)
                assert refused.value.body["param"] == param, refused.value.body
            with pytest.raises(BadRequestError) as refused:
                await client.responses.create(model="m", input="hi", tools=[{"type": "web_search"}])
            assert refused.value.body["param"] == "tools[0].type"


# ---- the Anthropic Messages API ----------------------------------------------------


async def test_messages_round_trip_a_tool_use_and_stream_it(tool_model_dir, tokenizer):
    question = [{"role": "user", "content": QUESTION}]
    async with greedy_gateway(tool_model_dir) as server:
        handle = server.open_session()
        async with _anthropic(handle) as client:
            first = await client.messages.create(
                model="m", max_tokens=40, messages=question, tools=ANTHROPIC_TOOLS
            )
            assert first.stop_reason == "tool_use" and first.stop_sequence is None
            (use,) = first.content
            assert use.type == "tool_use" and use.name == "add" and use.input == {"a": 2, "b": 3}
            conversation = [
                *question,
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}],
                },
            ]
            async with client.messages.stream(
                model="m", max_tokens=40, messages=conversation, tools=ANTHROPIC_TOOLS
            ) as stream:
                events = [event.type async for event in stream]
                second = await stream.get_final_message()
            counted = await client.messages.count_tokens(
                model="m", messages=conversation, tools=ANTHROPIC_TOOLS
            )
            stopped = await client.messages.create(
                model="m", max_tokens=40, messages=question, stop_sequences=["name"]
            )
        session = server.close_session(handle.id)
    assert second.content[0].type == "text" and second.content[0].text == ANSWER
    assert second.stop_reason == "end_turn" and second.id.startswith("msg_")
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert {"content_block_start", "text", "content_block_stop", "message_delta"} <= set(events)
    first_call, second_call, third_call = session.interactions
    assert counted.input_tokens == len(second_call.prompt_ids)
    sampled = first_call.prompt_ids + first_call.output_ids
    assert second_call.prompt_ids[: len(sampled)] == sampled
    assert [first_call.completion_id, second_call.completion_id] == [first.id, second.id]
    assert second.usage.output_tokens == len(second_call.output_ids)
    # the tool model answers `{"name": ...`: cut before the stop sequence, and named
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "name"
    assert stopped.content[0].text == '<tool_call>\n{"'
    assert third_call.output_text == stopped.content[0].text


async def test_messages_keys_errors_and_rewards_are_anthropics(tiny_model_dir):
    user = [{"role": "user", "content": "hi"}]
    async with greedy_gateway(tiny_model_dir) as server:
        handle = server.open_session()
        async with _anthropic(handle, auth_token=handle.api_key) as client:  # Bearer
            message = await client.messages.create(model="m", max_tokens=3, messages=user)
            assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
        async with _anthropic(handle, api_key="wrong") as client:
            with pytest.raises(anthropic.AuthenticationError) as refused:
                await client.messages.create(model="m", max_tokens=3, messages=user)
        assert refused.value.body["type"] == "error"
        assert refused.value.body["error"]["type"] == "authentication_error"
        bad = {
            "messages[0].content[0].type": {
                "max_tokens": 3,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            "messages[1]": {
                "max_tokens": 3,
                "messages": [*user, {"role": "assistant", "content": "The answer is"}],
            },
            "max_tokens": {"messages": user},
            "tools[0].input_schema": {
                "max_tokens": 3,
                "messages": user,
                "tools": [{"name": "add", "description": "a + b"}],
            },
        }
        async with httpx.AsyncClient(headers={"x-api-key": handle.api_key}) as http:
            for field, body in bad.items():
                answer = await http.post(f"{handle.base_url}/messages", json={"model": "m", **body})
                assert answer.status_code == 400
                error = answer.json()
                assert error["type"] == "error" and set(error) == {"type", "error"}
                assert error["error"]["type"] == "invalid_request_error"
                assert error["error"]["message"].startswith(field), error
        # a per-call reward by the Messages API's own id
        async with httpx.AsyncClient() as http:
            posted = await http.post(
                f"{server.url}/sessions/{handle.id}/reward",
                json={"rewards": {message.id: 0.5}},
                headers={"Authorization": f"Bearer {handle.reward_key}"},
            )
        assert posted.status_code == 200 and posted.json()["reward"] == {message.id: 0.5}


# ---- one conversation, three APIs --------------------------------------------------


@pytest.mark.parametrize("first_tool_choice", ["auto", "required", "operator"])
async def test_one_agent_over_three_apis_gives_the_same_sample_token_for_token(
    tool_model_dir, first_tool_choice
):
    """The calculator agent written against chat completions, the Responses API and the
    Messages API, on the same greedy model: the same tokens, the same mask, the same
    logprobs (up to rounding), the same reward; with the first call's tool forced each API's way too
    (`required`/`any`, a named function/tool)."""
    agents = [
        CalculatorAgent(first_tool_choice=first_tool_choice),
        CalculatorResponsesAgent(first_tool_choice=first_tool_choice),
        CalculatorAnthropicAgent(first_tool_choice=first_tool_choice),
    ]
    samples, seen = [], []
    config = greedy_config(tool_model_dir)
    async with start_single_process(startup.start(config, train=False), agents[0]) as parts:
        for agent in agents:
            result = await parts.controller.rollout_batch([ROW], workflow=agent)
            stats = result.stats()
            assert stats["completed"] == 1 and stats["concat_breaks"] == 0, (agent, stats)
            assert stats["calls"] >= 2  # a tool call, its result sent back, the answer
            keys = ("calls", "reward_mean", "tool_call_errors", "sampled_tokens")
            seen.append({key: stats[key] for key in keys})
            samples.append(result.trajectories[0])
    assert seen[0] == seen[1] == seen[2]
    if first_tool_choice != "operator":  # forced up to its arguments, it writes them badly
        assert seen[0]["reward_mean"] == 1.0 and seen[0]["tool_call_errors"] == 0
    chat, *others = samples
    for other in others:
        assert torch.equal(other.input_ids, chat.input_ids)
        assert torch.equal(other.loss_mask, chat.loss_mask)
        # the engine may reuse K/V cached from the earlier API's calls: the same tokens,
        # logprobs the same but for float rounding
        torch.testing.assert_close(
            other.behavior_logprobs, chat.behavior_logprobs, atol=1e-4, rtol=0
        )
        assert other.reward == chat.reward


async def test_the_agents_sdk_default_model_trains_unchanged(tool_model_dir):
    """OpenAIResponsesModel, the SDK's default: one sample per rollout, the call then
    the answer, as the chat-completions model gives."""
    tokenizer = load_tokenizer(tool_model_dir)
    config = greedy_config(tool_model_dir)
    agent = CalculatorSDKAgent(api="responses")
    async with start_single_process(startup.start(config, train=False), agent) as parts:
        result = await parts.controller.rollout_batch([ROW])
    assert_one_sample_round_trip(result, tokenizer)


@pytest.mark.parametrize(
    ("agent_class", "overrides"),
    [
        (CalculatorResponsesAgent, []),
        (CalculatorAnthropicAgent, []),
        (CalculatorSDKAgent, ["workflow.kwargs.api=responses"]),  # the SDK's default model
    ],
    ids=["responses", "anthropic", "agents-sdk-responses"],
)
async def test_responses_and_messages_agents_train_two_steps(
    tool_model_dir, tmp_path, agent_class, overrides
):
    await train_tool_agent_two_steps(tool_model_dir, tmp_path, agent_class, *overrides)
