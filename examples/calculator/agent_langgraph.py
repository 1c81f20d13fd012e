"""The calculator agent written with LangGraph, unchanged.

A two-node `StateGraph`: the model (`langchain_openai.ChatOpenAI` pointed at the
session's base_url, tools bound) and a prebuilt `ToolNode` that runs its calls and
sends each result back as a `ToolMessage`. The graph loops between them until the model
answers without a call, or its `max_turns`-th reply's calls have run.
"""

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

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


class CalculatorLangGraphAgent:
    def __init__(self, max_turns: int = 3):
        self.max_turns = max_turns

    async def run(self, data, *, base_url, api_key, model, **kw):
        llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, max_retries=0)
        llm = llm.bind_tools([add, multiply])

        async def call_model(state: MessagesState) -> dict:
            return {"messages": [await llm.ainvoke(state["messages"])]}

        def after_tools(state: MessagesState) -> str:
            turns = sum(isinstance(m, AIMessage) for m in state["messages"])
            return "model" if turns < self.max_turns else END

        graph = StateGraph(MessagesState)
        graph.add_node("model", call_model)
        graph.add_node("tools", ToolNode([add, multiply]))  # a bad call gets its error back
        graph.add_edge(START, "model")
        graph.add_conditional_edges("model", tools_condition)  # to "tools" or END
        graph.add_conditional_edges("tools", after_tools, ["model", END])
        messages = [SystemMessage(SYSTEM_PROMPT), HumanMessage(data["question"])]
        state = await graph.compile().ainvoke({"messages": messages})

        results = [
            m.content if m.status == "success" else f"error: {m.content}"
            for m in state["messages"]
            if isinstance(m, ToolMessage)
        ]
        last = state["messages"][-1]
        final = last.content if isinstance(last, AIMessage) else None  # None: out of turns
        return score(final, data["answer"], results)
