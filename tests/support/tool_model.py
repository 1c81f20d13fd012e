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
    """A two-number tool as the OpenAI Agents SDK ("sdk": strict, titled) or LangChain
    ("langchain": keys in another order) write its schema."""
    number = {"type": "number"}
    if framework == "langchain":
        properties = {"a": number, "b": number}
        parameters = {"properties": properties, "required": ["a", "b"], "type": "object"}
        function = {"name": name, "description": description, "parameters": parameters}
        return {"type": "function", "function": function}
    properties = {k: {"title": k.upper(), **number} for k in ("a", "b")}
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
    tokenizer = load_tokenizer(tiny_dir)
    model = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    pairs = conversations(tokenizer)
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
