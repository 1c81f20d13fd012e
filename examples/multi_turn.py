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

Every agent scores its last reply with `score` (examples/two_turn.py's
`final_number_reward`).
"""

from openai import AsyncOpenAI

from examples.two_turn import FOLLOW_UP as FINAL
from examples.two_turn import final_number_reward


def score(reply: str, answer) -> float:
    """`final_number_reward` for an answer given as a number or its text (reasoning-gym's
    rows), thousands separators in the reply ignored.

    >>> score("The answer is 1,200.", "1200"), score("-7", -7), score("12 or 13", "12")
    (1.0, 1.0, 0.0)
    """
    try:
        return final_number_reward(reply.replace(",", ""), float(answer))
    except ValueError:  # an answer that is not a number: no reply can match it
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
        return score(reply, data["answer"])


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
