"""The calculator's two tools and its reward, shared by every version of the agent.

Plain Python, no looprl imports: this is the user's code.
"""

import re

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
    for name, description in (("add", "Add two numbers."), ("multiply", "Multiply two numbers."))
]

SYSTEM_PROMPT = (
    "You are a calculator agent. Use a tool, then give the final number. For example, "
    'for "What is 2 + 3?" call add with {"a": 2, "b": 3}, read the result 5, and answer '
    '"The answer is 5."'
)


def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


def call_tool(name: str, arguments: dict) -> str:
    """Run one tool call; a bad call gets an error message back, as a real tool would."""
    tool = {"add": add, "multiply": multiply}.get(name)
    if tool is None:
        return f"error: there is no tool {name!r}"
    try:
        return format_number(tool(float(arguments["a"]), float(arguments["b"])))
    except (TypeError, KeyError, ValueError) as e:
        return f"error: {name}({arguments}) failed: {e!r}"


def format_number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def score(answer_text: str | None, answer: float, tool_results: list[str]) -> float:
    """1.0 for the right final number after a tool returned it, 0.5 when a tool ran,
    0.25 when the model called a tool with arguments it could not use, else 0.0.

    The partial credit gives a small model's first, mostly malformed calls a gradient.
    """
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer_text or "")
    right = bool(numbers) and float(numbers[-1]) == float(answer)
    if right and format_number(float(answer)) in tool_results:
        return 1.0
    if any(not r.startswith("error") for r in tool_results):
        return 0.5
    return 0.25 if tool_results else 0.0
