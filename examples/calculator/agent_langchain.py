"""The calculator agent written with LangChain (`langchain-openai`), unchanged.

`ChatOpenAI` is pointed at the session's base_url and the tools are bound with
`bind_tools`; the loop runs each tool call and sends back a `ToolMessage`.
"""

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from examples.calculator import tools
from examples.calculator.tools import SYSTEM_PROMPT, format_number, score


@tool
def add(a: float, b: float) -> str:
    """Add two numbers."""
    return format_number(tools.add(a, b))


@tool
def multiply(a: float, b: float) -> str:
    """Multiply two numbers."""
    return format_number(tools.multiply(a, b))


class CalculatorLangChainAgent:
    def __init__(self, max_turns: int = 3):
        self.max_turns = max_turns

    async def run(self, data, *, base_url, api_key, model, **kw):
        llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, max_retries=0)
        llm = llm.bind_tools([add, multiply])
        by_name = {"add": add, "multiply": multiply}  # a bad call gets its error back
        messages = [SystemMessage(SYSTEM_PROMPT), HumanMessage(data["question"])]
        results: list[str] = []
        for _ in range(self.max_turns):
            reply = await llm.ainvoke(messages)
            messages.append(reply)
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                try:
                    result = by_name[call["name"]].invoke(call["args"])
                except (KeyError, ValueError) as e:  # pydantic's ValidationError is a ValueError
                    result = f"error: {call['name']}({call['args']}) failed: {e}"
                results.append(result)
                messages.append(ToolMessage(result, tool_call_id=call["id"]))
        last = messages[-1]  # out of turns after a call, the last is the tool's result
        final = last.content if isinstance(last, AIMessage) and not last.tool_calls else None
        return score(final, data["answer"], results)
