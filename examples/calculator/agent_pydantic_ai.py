"""The calculator agent written with Pydantic AI (`pydantic-ai-slim[openai]`), unchanged.

The agent and its tools are defined once; each run gets an `OpenAIChatModel` whose
`OpenAICompatibleProvider` wraps an `AsyncOpenAI` client on the session's base_url.
The tools record their results in the run's `deps`, which the reward reads. A call
whose arguments do not validate gets the error back as a retry prompt; a run that ends
without an answer (out of turns, or of retries after an empty reply or bad calls) scores
the tools' results alone.
"""

from openai import AsyncOpenAI
from pydantic_ai import (
    Agent,
    RunContext,
    UnexpectedModelBehavior,
    UsageLimitExceeded,
    UsageLimits,
)
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai_compatible import OpenAICompatibleProvider

from examples.calculator import tools
from examples.calculator.tools import SYSTEM_PROMPT, format_number, score

calculator = Agent(instructions=SYSTEM_PROMPT, deps_type=list[str])


@calculator.tool
def add(ctx: RunContext[list[str]], a: float, b: float) -> str:
    """Add two numbers."""
    ctx.deps.append(format_number(tools.add(a, b)))
    return ctx.deps[-1]


@calculator.tool
def multiply(ctx: RunContext[list[str]], a: float, b: float) -> str:
    """Multiply two numbers."""
    ctx.deps.append(format_number(tools.multiply(a, b)))
    return ctx.deps[-1]


class CalculatorPydanticAIAgent:
    def __init__(self, max_turns: int = 3):
        self.max_turns = max_turns

    async def run(self, data, *, base_url, api_key, model, **kw):
        results: list[str] = []
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        provider = OpenAICompatibleProvider("looprl", openai_client=client)
        try:
            result = await calculator.run(
                data["question"],
                model=OpenAIChatModel(model, provider=provider),
                deps=results,
                usage_limits=UsageLimits(request_limit=self.max_turns),
            )
            final = result.output
        except (UsageLimitExceeded, UnexpectedModelBehavior):  # out of turns, or of retries
            final = None
        finally:
            await client.close()
        return score(final, data["answer"], results)
