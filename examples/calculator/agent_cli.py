"""The calculator agent as a separate program, for `workflow.mode=subprocess`.

No workflow class is handed to looprl: the program reads the row from LOOPRL_DATA,
runs the same plain-`openai` agent against OPENAI_BASE_URL / OPENAI_API_KEY (what
every OpenAI client reads), and posts its reward to LOOPRL_REWARD_URL with
LOOPRL_REWARD_KEY. A program in any language can do the same. It takes the reward
variables out of its environment first, so nothing it starts (a tool the model drives)
inherits the key that sets the rollout's reward.

    looprl train workflow.mode=subprocess \
        "workflow.command=python -m examples.calculator.agent_cli"
"""

import asyncio
import json
import os

import httpx

from examples.calculator.agent_openai import CalculatorAgent


def main() -> None:
    reward_url = os.environ.pop("LOOPRL_REWARD_URL")
    reward_key = os.environ.pop("LOOPRL_REWARD_KEY")
    data = json.loads(os.environ["LOOPRL_DATA"])
    endpoint = {"base_url": os.environ["OPENAI_BASE_URL"], "api_key": os.environ["OPENAI_API_KEY"]}
    reward = asyncio.run(CalculatorAgent().run(data, model=os.environ["OPENAI_MODEL"], **endpoint))
    httpx.post(
        reward_url, json={"reward": reward}, headers={"Authorization": f"Bearer {reward_key}"}
    ).raise_for_status()


if __name__ == "__main__":
    main()
