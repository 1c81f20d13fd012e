"""The calculator agent with the plain `openai` client and OpenAI tool calling.

Up to `max_turns` model calls: each tool call is run and its result sent back as a
`role: tool` message, until the model answers without calling a tool. Train it with:

    looprl train examples/calculator.yaml
"""

import json

from openai import AsyncOpenAI

from examples.calculator.tools import SYSTEM_PROMPT, TOOLS, call_tool, score


class CalculatorAgent:
    """`first_tool_choice`: "auto", "required", or "operator": the agent picks the tool
    from the question's operator and the model writes its arguments."""

    def __init__(self, max_turns: int = 3, first_tool_choice: str = "auto"):
        self.max_turns = max_turns
        self.first_tool_choice = first_tool_choice

    def _first_choice(self, question: str):
        if self.first_tool_choice != "operator":
            return self.first_tool_choice
        name = "multiply" if "*" in question else "add"
        return {"type": "function", "function": {"name": name}}

    async def run(self, data, *, base_url, api_key, model, **kw):
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": data["question"]},
        ]
        results: list[str] = []
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            for turn in range(self.max_turns):
                response = await client.chat.completions.create(
                    model=model,
                    messages=messages,
                    tools=TOOLS,
                    tool_choice=self._first_choice(data["question"]) if turn == 0 else "auto",
                )
                message = response.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    result = call_tool(call.function.name, json.loads(call.function.arguments))
                    results.append(result)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        final = messages[-1].get("content") if messages[-1]["role"] == "assistant" else None
        return score(final, data["answer"], results)
