"""The calculator agent with the plain `openai` client and the Responses API.

The same agent as agent_openai.py, written against `client.responses.create`: the
output items (function calls) go back as input items with a `function_call_output`
for each, until the model answers without calling a tool. Train it with:

    looprl train examples/calculator.yaml \\
        workflow.path=examples.calculator.agent_responses:CalculatorResponsesAgent
"""

import json

from openai import AsyncOpenAI

from examples.calculator.tools import SYSTEM_PROMPT, TOOLS, call_tool, score

# The tools in the Responses API's form: the function's fields at the top level.
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]


class CalculatorResponsesAgent:
    """`first_tool_choice`: "auto", "required", or "operator": the agent picks the tool
    from the question's operator and the model writes its arguments."""

    def __init__(self, max_turns: int = 3, first_tool_choice: str = "auto"):
        self.max_turns = max_turns
        self.first_tool_choice = first_tool_choice

    def _choice(self, question: str, turn: int):
        if turn > 0 or self.first_tool_choice != "operator":
            return self.first_tool_choice if turn == 0 else "auto"
        return {"type": "function", "name": "multiply" if "*" in question else "add"}

    async def run(self, data, *, base_url, api_key, model, **kw):
        items: list[dict] = [{"role": "user", "content": data["question"]}]
        results: list[str] = []
        final = None
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            for turn in range(self.max_turns):
                response = await client.responses.create(
                    model=model,
                    instructions=SYSTEM_PROMPT,
                    input=items,
                    tools=RESPONSES_TOOLS,
                    tool_choice=self._choice(data["question"], turn),
                )
                items += [item.model_dump(exclude_none=True) for item in response.output]
                calls = [item for item in response.output if item.type == "function_call"]
                if not calls:
                    final = response.output_text
                    break
                for call in calls:
                    result = call_tool(call.name, json.loads(call.arguments))
                    results.append(result)
                    items.append(
                        {"type": "function_call_output", "call_id": call.call_id, "output": result}
                    )
        return score(final, data["answer"], results)
