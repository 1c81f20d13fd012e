"""The calculator agent with the `anthropic` SDK and the Messages API.

The same agent as agent_openai.py, written against `client.messages.create`: the
model's `tool_use` blocks are run and sent back as `tool_result` blocks in a user
message, until the model answers without calling a tool. The Anthropic client takes
the session's base URL without its `/v1` (it adds `/v1/messages` itself); an agent in
a subprocess (workflow.mode=subprocess) reads ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY
instead, as every Anthropic client does. Train it with:

    looprl train examples/calculator.yaml \\
        workflow.path=examples.calculator.agent_anthropic:CalculatorAnthropicAgent
"""

from anthropic import AsyncAnthropic

from examples.calculator.tools import SYSTEM_PROMPT, TOOLS, call_tool, score

# The tools in the Messages API's form: `input_schema` holds the parameters' schema.
ANTHROPIC_TOOLS = [
    {
        "name": tool["function"]["name"],
        "description": tool["function"]["description"],
        "input_schema": tool["function"]["parameters"],
    }
    for tool in TOOLS
]


class CalculatorAnthropicAgent:
    """`max_tokens` is required by the Messages API; 40 is what the calculator config
    gives the other agents (sampling.max_new_tokens). `first_tool_choice`: "auto",
    "required" (Anthropic's `any`), or "operator": the agent picks the tool from the
    question's operator and the model writes its arguments."""

    def __init__(self, max_turns: int = 3, max_tokens: int = 40, first_tool_choice: str = "auto"):
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.first_tool_choice = first_tool_choice

    def _choice(self, question: str, turn: int) -> dict:
        choice = self.first_tool_choice if turn == 0 else "auto"
        if choice == "operator":
            return {"type": "tool", "name": "multiply" if "*" in question else "add"}
        return {"type": {"auto": "auto", "required": "any"}[choice]}

    async def run(self, data, *, base_url, api_key, model, **kw):
        messages: list[dict] = [{"role": "user", "content": data["question"]}]
        results: list[str] = []
        final = None
        root = base_url.removesuffix("/v1")
        async with AsyncAnthropic(base_url=root, api_key=api_key, max_retries=0) as client:
            for turn in range(self.max_turns):
                message = await client.messages.create(
                    model=model,
                    max_tokens=self.max_tokens,
                    system=SYSTEM_PROMPT,
                    messages=messages,
                    tools=ANTHROPIC_TOOLS,
                    tool_choice=self._choice(data["question"], turn),
                )
                content = [block.model_dump(exclude_none=True) for block in message.content]
                messages.append({"role": "assistant", "content": content})
                calls = [block for block in message.content if block.type == "tool_use"]
                if not calls:
                    final = "".join(b.text for b in message.content if b.type == "text")
                    break
                answers = []
                for call in calls:
                    result = call_tool(call.name, call.input)
                    results.append(result)
                    answer = {"type": "tool_result", "tool_use_id": call.id}
                    answers.append({**answer, "content": result})
                messages.append({"role": "user", "content": answers})
        return score(final, data["answer"], results)
