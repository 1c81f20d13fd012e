"""The toy job the e2e tests train: a tiny model learns a reward it can only reach by
learning.

The toy reward is the fraction of sampled tokens with an even id (EvenTokenAgent): a
random-init model starts near 0.5, and only learning (weights moving and reaching the
engine) raises it. Runs name the agent by its path, `tests.support.toy_job:EvenTokenAgent`.
"""

from __future__ import annotations

from openai import AsyncOpenAI

from looprl.config import Config, load_config
from tests.support.tiny_run import metrics_records, tiny_run_overrides

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
    return load_config(None, toy_job_overrides(model_dir, root, *overrides))


def toy_job_overrides(model_dir, root, *overrides: str) -> list[str]:
    """`toy_job`'s overrides, as `looprl train` takes them on its command line."""
    return tiny_run_overrides(
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
    the weights of the step before (the engine got them), and the policy learned.

    Learned means the evaluation (greedy, the same prompts before and after: unchanged
    weights give the same 0.281 every time) rose by 0.15, and the sampled reward rose
    above its first three steps at some later step. Full fine-tuning reaches 1.0; LoRA
    under Ray, the slowest, was seen at 0.5 and 0.69.
    The sampled reward alone is no verdict: an asynchronous run (rollouts up to two
    versions stale, lr 3e-3) has been seen to dip from 0.65 to 0.14 and come back while
    its greedy evaluation went from 0.28 to 1.0 (CI, stop 41)."""
    steps = metrics_records(cfg.run_dir, "train")
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert [r["version"] for r in steps] == list(range(1, 11))
    rewards = [round(r["reward_mean"], 3) for r in steps]
    evals = [(r["step"], round(r["reward_mean"], 3)) for r in metrics_records(cfg.run_dir, "eval")]
    print(f"toy rewards per step ({label}):", rewards, "eval:", evals)
    assert [s for s, _ in evals] == [0, 10], evals
    assert evals[-1][1] > evals[0][1] + 0.15, evals
    first = sum(rewards[:3]) / 3
    assert max(rewards[3:]) > first + 0.1, rewards
    return steps
