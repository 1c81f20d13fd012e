"""RLVRWorkflow, the built-in workflow: one chat turn, scored by the configured reward
(the task's function, a sandboxed code run, or an LLM judge)."""

from __future__ import annotations

from typing import Any

from looprl.rewards import FunctionReward, Reward, RewardFn
from looprl.workflows.client import session_client
from looprl.workflows.imports import import_object


class RLVRWorkflow:
    """One chat turn through the `openai` client, scored by a reward function.

    `reward_fn(prompt, completion, **row) -> float` is called with the prompt text, the
    model's answer and the dataset row's fields (e.g. `answer`); it may also be a
    `looprl.rewards.Reward` (a sandboxed code run, an LLM judge), which may return None
    to reject the rollout. Sampling settings (temperature, max tokens) are left to the
    gateway, which applies the run's config.
    """

    def __init__(
        self,
        reward_fn: RewardFn | Reward | str,
        prompt_field: str = "question",
        system_prompt: str | None = None,
    ):
        if isinstance(reward_fn, str):
            reward_fn = import_object(reward_fn, "reward")
        self.reward = reward_fn if isinstance(reward_fn, Reward) else FunctionReward(reward_fn)
        self.prompt_field = prompt_field
        self.system_prompt = system_prompt

    async def run(self, data: dict, *, base_url: str, api_key: str, model: str, **kw: Any):
        if self.prompt_field not in data:
            raise KeyError(
                f"dataset row has no field {self.prompt_field!r} "
                f"(fields: {sorted(data)}); set task.prompt_field"
            )
        prompt = str(data[self.prompt_field])
        messages = chat_messages(prompt, self.system_prompt)
        # The reward's context spans the call: a group judge waits for every rollout of
        # the row that is still running before it scores them together.
        async with self.reward.rollout(data) as score:
            async with session_client(base_url, api_key) as client:
                response = await client.chat.completions.create(model=model, messages=messages)
            completion = response.choices[0].message.content or ""
            return await score(prompt, completion)


def chat_messages(prompt: str, system_prompt: str | None) -> list[dict[str, str]]:
    """The chat RLVRWorkflow sends: the prompt as the user's turn, after the system
    prompt when there is one (else the chat template's default applies)."""
    messages = [{"role": "user", "content": prompt}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages
