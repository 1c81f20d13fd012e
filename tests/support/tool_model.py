"""A tiny model that has learned to use a calculator tool, for tool-calling tests.

SmolLM2-135M rarely writes a well-formed tool call, and a random model never does, so
tests that need a call sampled from real tokens use this: the tiny 2-layer Llama of
`conftest.tiny_model_dir`, fine-tuned for a few seconds on conversations rendered by
the gateway's own tool format. Greedy, it answers a question with
`<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>` and a tool
result with "The answer is 5.", whatever the system prompt and tool schemas.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from examples.calculator.tools import SYSTEM_PROMPT, TOOLS
from looprl.config import Config, load_config
from looprl.gateway import tools as tools_lib
from looprl.models import load_tokenizer

CALL = tools_lib.format_call("add", {"a": 2, "b": 3})
ANSWER = "The answer is 5."


def _as_written_by(framework: str, name: str, description: str) -> dict:
    """A two-number tool as the OpenAI Agents SDK ("sdk": strict, titled), LangChain
    ("langchain": keys in another order) or an MCP server's tool in the SDK ("mcp":
    FastMCP's titles, not strict) write its schema."""
    number = {"type": "number"}
    if framework == "langchain":
        properties = {"a": number, "b": number}
        parameters = {"properties": properties, "required": ["a", "b"], "type": "object"}
        function = {"name": name, "description": description, "parameters": parameters}
        return {"type": "function", "function": function}
    properties = {k: {"title": k.upper(), **number} for k in ("a", "b")}
    if framework == "mcp":  # FastMCP's inputSchema, as the Agents SDK passes it on
        parameters = {"properties": properties, "required": ["a", "b"]}
        parameters.update(title=f"{name}Arguments", type="object")
        function = {"name": name, "description": description, "parameters": parameters}
        return {"type": "function", "function": {**function, "strict": False}}
    parameters = {"type": "object", "properties": properties, "required": ["a", "b"]}
    parameters.update(title=f"{name}_args", additionalProperties=False)
    function = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": {**function, "strict": True}}


def greedy_config(model_dir: Path, *overrides: str) -> Config:
    """A config that runs `model_dir` greedily in float32, one rollout per row: what the
    tool model's tests need to see its calls every time."""
    base = [
        f"model.path={model_dir}",
        "engine.dtype=float32",
        "sampling.temperature=0",
        "sampling.max_new_tokens=40",
        "rollout.group_size=1",
    ]
    return load_config(None, [*base, *overrides])


def conversations(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) pairs: a question -> CALL, a tool result -> ANSWER."""
    toolsets = [
        TOOLS,
        [_as_written_by("sdk", "add", "Return a + b."), _as_written_by("sdk", "multiply", "a * b")],
        [
            _as_written_by("langchain", "add", "Add two numbers."),
            _as_written_by("langchain", "multiply", "x"),
        ],
        [_as_written_by("mcp", "add", "Add two numbers."), _as_written_by("mcp", "multiply", "x")],
    ]
    pairs = []
    for tools in toolsets:
        for system in (None, SYSTEM_PROMPT):
            for question in ("What is 2 + 3?", "Add 2 and 3."):
                first = [{"role": "user", "content": question}]
                if system:
                    first.insert(0, {"role": "system", "content": system})
                second = [
                    *first,
                    {"role": "assistant", "content": CALL},
                    {"role": "tool", "content": "5", "tool_call_id": "call_0"},
                ]
                for messages, target in ((first, CALL), (second, ANSWER)):
                    rendered = tools_lib.render_messages(
                        messages, tools, native=False, sampled_texts={}
                    )
                    text = tokenizer.apply_chat_template(
                        rendered, add_generation_prompt=True, tokenize=False
                    )
                    prompt = tokenizer(text, add_special_tokens=False).input_ids
                    out = tokenizer(target, add_special_tokens=False).input_ids
                    pairs.append((prompt, [*out, tokenizer.eos_token_id]))
    return pairs


def train_tool_model(tiny_dir: Path, out: Path, steps: int = 40) -> Path:
    return fine_tune(tiny_dir, out, conversations(load_tokenizer(tiny_dir)), steps)


def fine_tune(
    model_dir: Path, out: Path, pairs: list[tuple[list[int], list[int]]], steps: int = 40
) -> Path:
    """`model_dir` fine-tuned on (prompt ids, target ids) `pairs`, the loss on the targets
    only, saved to `out` with its tokenizer."""
    tokenizer = load_tokenizer(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    length = max(len(p) + len(t) for p, t in pairs)
    ids = torch.full((len(pairs), length), tokenizer.pad_token_id)
    labels = torch.full((len(pairs), length), -100)
    attention = torch.zeros((len(pairs), length), dtype=torch.long)
    for i, (prompt, target) in enumerate(pairs):
        n = len(prompt) + len(target)
        ids[i, :n] = torch.tensor(prompt + target)
        labels[i, len(prompt) : n] = torch.tensor(target)
        attention[i, :n] = 1
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    targets = labels[:, 1:] != -100
    for _ in range(steps):
        hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
        logits = model.lm_head(hidden[:, :-1][targets])  # only where a target token is
        loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:][targets])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def assert_one_sample_round_trip(
    result, tokenizer, calls: int | None = None, call: str = CALL
) -> str:
    """Checks a greedy tool-model rollout (`RolloutResult` of one row): it completed
    with reward 1.0 (the tool ran and the answer used its result), made `calls` calls
    (default: at least 2; the tiny model sometimes calls the tool once more before
    answering), and is one sample whose sampled tokens are exactly the calls then the
    answer (`call` is each call's text), with one tool result per call sent back between
    them. Returns the text of
    the tokens not sampled (the prompt and what was sent back)."""
    stats = result.stats()
    assert stats["completed"] == 1 and stats["reward_mean"] == 1.0, stats
    assert stats["calls"] >= 2 if calls is None else stats["calls"] == calls, stats
    assert stats["concat_breaks"] == 0 and stats["tool_call_errors"] == 0, stats
    calls = stats["calls"]
    (sample,) = result.trajectories
    sampled = sample.input_ids[sample.loss_mask].tolist()
    call_ids = [*tokenizer(call, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    answer_ids = [*tokenizer(ANSWER, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    assert sampled == call_ids * (calls - 1) + answer_ids  # the outputs, nothing sent back
    unmasked = tokenizer.decode(sample.input_ids[~sample.loss_mask])
    assert unmasked.count("<tool_response>\n5\n</tool_response>") == calls - 1
    transitions = sample.loss_mask.int().diff().ne(0).sum()
    assert transitions == 2 * calls - 1  # one run of sampled tokens per call, the last at the end
    return unmasked
