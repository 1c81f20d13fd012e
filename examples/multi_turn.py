"""Agents whose first replies are long and unrewarded and whose reward reads only a
later, short reply, each with its one-turn twin: the benchmark of multi-turn learning
(issue 52; bench/multi_turn.py runs them, BENCHMARKS.md has the figures). Plain
`openai`, no looprl imports, as a user writes them.

- `WorkThenNumber`: the question, answered freely; then "Reply with only the final
  number." (scored). The shape of examples/two_turn.py on harder tasks.
- `PlanThenNumber`: "Explain how you would solve this" (a plan, not the answer); then
  "Now reply with only the final number." (scored).
- `AnswerCheckNumber`: three turns: the question; "Check your answer step by step.";
  "Reply with only the final number." (scored).
- `OneTurn`: the question and "Reply with only the final number." in one message: the
  twin every agent above is compared with, on the same rows.

Every agent scores with `final_number_reward` on its last reply.
"""

import re

from openai import AsyncOpenAI

FINAL = "Reply with only the final number."
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number_reward(reply: str, answer) -> float:
    """1.0 when the last number in the reply equals `answer` (a number or its text), else 0.

    >>> final_number_reward("The answer is 1,200.", "1200"), final_number_reward("-7", -7)
    (1.0, 1.0)
    >>> final_number_reward("12 or 13", 12), final_number_reward("no number", 12)
    (0.0, 0.0)
    """
    numbers = _NUMBER.findall(reply)
    if not numbers:
        return 0.0
    try:
        return 1.0 if float(numbers[-1].replace(",", "")) == float(answer) else 0.0
    except ValueError:
        return 0.0


async def _chat(client: AsyncOpenAI, model: str, follow_ups: list[str]) -> str:
    """Send each message in turn, each after the model's reply to the one before; the
    last reply."""
    messages: list[dict] = []
    reply = ""
    for content in follow_ups:
        messages.append({"role": "user", "content": content})
        response = await client.chat.completions.create(model=model, messages=messages)
        reply = response.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
    return reply


class _Agent:
    def turns(self, question: str) -> list[str]:
        raise NotImplementedError

    async def run(self, data, *, base_url, api_key, model, **kw):
        async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
            reply = await _chat(client, model, self.turns(data["question"]))
        return final_number_reward(reply, data["answer"])


class WorkThenNumber(_Agent):
    def turns(self, question):
        return [question, FINAL]


class PlanThenNumber(_Agent):
    def turns(self, question):
        return [
            f"Explain how you would solve this problem, without solving it: {question}",
            f"Now solve it. {FINAL}",
        ]


class AnswerCheckNumber(_Agent):
    def turns(self, question):
        return [question, "Check your answer step by step.", FINAL]


class OneTurn(_Agent):
    def turns(self, question):
        return [f"{question} {FINAL}"]
