"""The calculator agent written with the Claude Agent SDK (`claude-agent-sdk`), unchanged.

The SDK runs the Claude Code CLI it bundles as a child process; the CLI calls the
model over Anthropic's Messages API at ANTHROPIC_BASE_URL, here the session's gateway
URL (without its `/v1`), with the session's key as ANTHROPIC_API_KEY. The two tools
are an in-process MCP server's (`create_sdk_mcp_server`), so the model sees them as
`mcp__calculator__add` and `mcp__calculator__multiply`; Claude Code's own tools (Bash,
Read, Edit, ...) are off (`tools=[]`), which also keeps its prompt to about 600 tokens
(SmolLM2's tokenizer) instead of about 11,000 with them. Train it with:

    looprl train examples/calculator.yaml \\
        workflow.path=examples.calculator.agent_claude:CalculatorClaudeAgent \\
        "workflow.kwargs={max_turns: 2}"

What the CLI does on its own, each rollout: it first sends the environment block (the
working directory, platform, date) as a `role: "system"` message, which the gateway
refuses with a 400, and then sends it again as `<system-reminder>` text in the user
message, which it keeps for the rest of the session; no other model is called (with
CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC). Each rollout gets a new empty directory as
the CLI's working directory, HOME and config directory, so nothing carries over from one
rollout to the next. The CLI inherits the rest of looprl's environment (the SDK
passes `os.environ` on).
"""

import logging
import tempfile

from claude_agent_sdk import (
    ClaudeAgentOptions,
    ResultError,
    ResultMessage,
    create_sdk_mcp_server,
    query,
    tool,
)

from examples.calculator.tools import SYSTEM_PROMPT, TOOLS, call_tool, score

log = logging.getLogger(__name__)

SERVER = "calculator"  # the MCP server's name: its tools are mcp__calculator__<name>

# Claude Code's traffic that is not the model's calls (telemetry, error reports, update
# checks) has nowhere to go from a training machine.
QUIET_ENV = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}


class CalculatorClaudeAgent:
    """`max_tokens` becomes the CLI's CLAUDE_CODE_MAX_OUTPUT_TOKENS: without it the CLI
    asks for 32,000 per call, which wins over the run's sampling.max_new_tokens; 40 is
    what the calculator config gives the other agents."""

    def __init__(self, max_turns: int = 3, max_tokens: int = 40):
        self.max_turns = max_turns
        self.max_tokens = max_tokens

    async def run(self, data, *, base_url, api_key, model, **kw):
        results: list[str] = []

        def calculator_tool(function: dict):
            """A chat-completions tool as an MCP tool that runs `call_tool`."""

            @tool(function["name"], function["description"], function["parameters"])
            async def run_tool(arguments: dict) -> dict:
                results.append(call_tool(function["name"], arguments))
                return {"content": [{"type": "text", "text": results[-1]}]}

            return run_tool

        server = create_sdk_mcp_server(
            SERVER, tools=[calculator_tool(t["function"]) for t in TOOLS]
        )
        final = None
        with tempfile.TemporaryDirectory(prefix="claude-agent-") as home:
            env = {
                **QUIET_ENV,
                "ANTHROPIC_BASE_URL": base_url.rstrip("/").removesuffix("/v1"),
                "ANTHROPIC_API_KEY": api_key,
                "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(self.max_tokens),
                "HOME": home,
                "CLAUDE_CONFIG_DIR": home,
            }
            options = ClaudeAgentOptions(
                model=model,
                system_prompt=SYSTEM_PROMPT,
                tools=[],  # none of Claude Code's own
                mcp_servers={SERVER: server},
                allowed_tools=[f"mcp__{SERVER}__{t['function']['name']}" for t in TOOLS],
                setting_sources=[],  # no user, project or local settings files
                max_turns=self.max_turns,
                cwd=home,
                env=env,
                extra_args={"no-session-persistence": None},
                # a line per rollout otherwise: "[claude-code:unrecognized_model]", as the
                # policy's name is no Claude model's; its errors come back as ResultError
                stderr=log.debug,
            )
            try:
                async for message in query(prompt=data["question"], options=options):
                    if isinstance(message, ResultMessage) and not message.is_error:
                        final = message.result
            except ResultError as e:
                if e.api_error_status is not None:  # the gateway refused a call: not a score
                    raise
                # the model ran out of turns, or of output tokens (after the CLI's own
                # "Output token limit hit. Resume directly" retries): no final answer
        return score(final, data["answer"], results)
