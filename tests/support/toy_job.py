"""The toy job the e2e tests train: a tiny model learns a reward it can only reach by
learning.

The toy reward is the fraction of sampled tokens with an even id (EvenTokenAgent): a
random-init model starts near 0.5, and only learning (weights moving and reaching the
engine) raises it. Runs name the agent by its path, `tests.support.toy_job:EvenTokenAgent`.
"""

from __future__ import annotations

from openai import AsyncOpenAI

from looprl.config import Config
from tests.support.tiny_run import metrics_records, tiny_run_config

EVEN_TOKEN_AGENT = "tests.support.toy_job:EvenTokenAgent"


class EvenTokenAgent:
    async def run(self, data, *, base_url, api_key, model, **kw):
        async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
            response = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": data["question"]}]
            )
        ids = response.choices[0].token_ids  # extra field: the sampled token ids
        return sum(i % 2 == 0 for i in ids) / len(ids)


def toy_job(model_dir, root, *overrides: str) -> Config:
    """10 steps of 4 x 8 rollouts of 8 tokens, float32, rewarded by EvenTokenAgent."""
    return tiny_run_config(
        model_dir,
        root,
        f"workflow.path={EVEN_TOKEN_AGENT}",
        "train.lr=3e-3",
        "train.total_steps=10",
        "rollout.batch_size=4",
        "rollout.group_size=8",
        "sampling.max_new_tokens=8",
        "eval.size=4",
        "eval.max_new_tokens=8",
        *overrides,
    )


def learned_steps(cfg: Config, label: str) -> list[dict]:
    """The train records of a finished toy job, checked: all 10 steps, each sampled with
    the weights of the step before (the engine got them), and the reward risen."""
    steps = metrics_records(cfg.run_dir, "train")
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert [r["version"] for r in steps] == list(range(1, 11))
    first = sum(r["reward_mean"] for r in steps[:3]) / 3
    last = sum(r["reward_mean"] for r in steps[-3:]) / 3
    rewards = [round(r["reward_mean"], 3) for r in steps]
    print(f"toy rewards per step ({label}):", rewards)
    assert last > first + 0.15, rewards
    return steps
