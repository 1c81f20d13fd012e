"""The calculator agent as a separate program, for `workflow.mode=subprocess`.

No looprl imports and no workflow class: it reads the row from LOOPRL_DATA, lets the
`openai` client find OPENAI_BASE_URL / OPENAI_API_KEY in the environment as it always
does, and posts its reward to LOOPRL_REWARD_URL. Any language can do the same.

    looprl train examples/calculator_subprocess.yaml
"""

import json
import os

import httpx
from openai import OpenAI

from examples.calculator.tools import SYSTEM_PROMPT, TOOLS, call_tool, score


def main() -> None:
    data = json.loads(os.environ["LOOPRL_DATA"])
    client = OpenAI(max_retries=0)
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": data["question"]},
    ]
    results = []
    for _ in range(3):
        response = client.chat.completions.create(
            model=os.environ["OPENAI_MODEL"], messages=messages, tools=TOOLS
        )
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = call_tool(call.function.name, json.loads(call.function.arguments))
            results.append(result)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = messages[-1].get("content") if messages[-1]["role"] == "assistant" else None
    reward = score(final, data["answer"], results)
    httpx.post(
        os.environ["LOOPRL_REWARD_URL"],
        json={"reward": reward},
        headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"},
    ).raise_for_status()


if __name__ == "__main__":
    main()
