"""The calculator agent as a separate program, for `workflow.mode=subprocess`.

No workflow class is handed to looprl: the program reads the row from LOOPRL_DATA,
runs the same plain-`openai` agent against OPENAI_BASE_URL / OPENAI_API_KEY (what
every OpenAI client reads), and posts its reward to LOOPRL_REWARD_URL. A program in
any language can do the same.

    looprl train workflow.mode=subprocess \
        "workflow.command=python -m examples.calculator.agent_cli"
"""

import asyncio
import json
import os

import httpx

from examples.calculator.agent_openai import CalculatorAgent


def main() -> None:
    data = json.loads(os.environ["LOOPRL_DATA"])
    key = os.environ["OPENAI_API_KEY"]
    endpoint = {"base_url": os.environ["OPENAI_BASE_URL"], "api_key": key}
    reward = asyncio.run(CalculatorAgent().run(data, model=os.environ["OPENAI_MODEL"], **endpoint))
    httpx.post(
        os.environ["LOOPRL_REWARD_URL"],
        json={"reward": reward},
        headers={"Authorization": f"Bearer {key}"},
    ).raise_for_status()


if __name__ == "__main__":
    main()
