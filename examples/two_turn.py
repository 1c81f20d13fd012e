"""The same question asked in two turns and in one, written as a user would: plain
`openai`, no looprl imports. Issue 34 compares how fast each learns on the same rows
(examples/two_turn.yaml vs examples/one_turn.yaml).

- `TwoTurnAgent`: turn 1 is the question alone, answered in words; turn 2 asks for only
  the final number, and the reward is on that second reply.
- `OneTurnAgent`: the question and the same instruction in one message, the reward on
  its reply.

Both score with `final_number_reward`. The two-turn session's second prompt extends the
first, so it trains as one sample (both replies sampled, the follow-up masked out) with
the rollout's reward.
"""

import re

from openai import AsyncOpenAI

FOLLOW_UP = "Reply with only the final number."
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_number_reward(reply: str, answer: int) -> float:
    """1.0 when the last number in the reply equals the answer, else 0.0.

    >>> final_number_reward("The answer is 12.", 12), final_number_reward("12", 12)
    (1.0, 1.0)
    >>> final_number_reward("12 or 13", 12), final_number_reward("no number", 12)
    (0.0, 0.0)
    """
    numbers = _NUMBER.findall(reply)
    return 1.0 if numbers and float(numbers[-1]) == answer else 0.0


async def _reply(client: AsyncOpenAI, model: str, messages: list[dict]) -> str:
    response = await client.chat.completions.create(model=model, messages=messages)
    return response.choices[0].message.content or ""


class TwoTurnAgent:
    async def run(self, data, *, base_url, api_key, model, **kw):
        async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
            messages = [{"role": "user", "content": data["question"]}]
            answer = await _reply(client, model, messages)
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": FOLLOW_UP},
            ]
            final = await _reply(client, model, messages)
        return final_number_reward(final, data["answer"])


class OneTurnAgent:
    async def run(self, data, *, base_url, api_key, model, **kw):
        async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
            question = f"{data['question']} {FOLLOW_UP}"
            final = await _reply(client, model, [{"role": "user", "content": question}])
        return final_number_reward(final, data["answer"])
