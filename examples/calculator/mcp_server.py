"""The calculator's two tools, `add` and `multiply`, as a stdio MCP server (FastMCP).

An MCP client starts it as a child process and talks JSON-RPC over its stdin/stdout:

    python -m examples.calculator.mcp_server          # from the repository root
    python examples/calculator/mcp_server.py          # or by path, from anywhere

Each tool answers with the number as text, formatted like the other agents' tools
("5", not "5.0"), so the model sees the same tool results whichever agent runs it.
"""

import sys
from pathlib import Path

if not __package__:  # run by path: make the repository's `examples` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mcp.server.fastmcp import FastMCP  # noqa: E402

from examples.calculator import tools  # noqa: E402
from examples.calculator.tools import format_number  # noqa: E402

server = FastMCP("calculator", log_level="WARNING")  # not a line on stderr per request


@server.tool()
def add(a: float, b: float) -> str:
    """Add two numbers."""
    return format_number(tools.add(a, b))


@server.tool()
def multiply(a: float, b: float) -> str:
    """Multiply two numbers."""
    return format_number(tools.multiply(a, b))


if __name__ == "__main__":
    server.run("stdio")
