"""A custom agent, written as a user would: plain `openai` code, no looprl imports.

The agent answers, then is asked to double-check, and is rewarded on its final number.
Both calls go through the session's base_url, so looprl records every sampled token;
the second prompt extends the first, so the session trains as one sample with the
user's follow-up masked out. Train it with:

    looprl train examples/custom_workflow.yaml
"""

import re

from openai import AsyncOpenAI


class DoubleCheckAgent:
    def __init__(self, follow_up: str = "Check your answer. Reply with the final number only."):
        self.follow_up = follow_up

    async def run(self, data, *, base_url, api_key, model, **kw):
        client = AsyncOpenAI(base_url=base_url, api_key=api_key)
        messages = [{"role": "user", "content": data["question"]}]
        first = await client.chat.completions.create(model=model, messages=messages)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": self.follow_up},
        ]
        final = await client.chat.completions.create(model=model, messages=messages)
        await client.close()
        numbers = re.findall(r"-?\d+", final.choices[0].message.content or "")
        return 1.0 if numbers and int(numbers[-1]) == data["answer"] else 0.0
