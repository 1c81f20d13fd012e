"""Built-in tasks: datasets with their reward functions.

`load_task(cfg)` returns a Task (train rows, held-out rows, reward function) for the
`task` section of the config: the generated `arithmetic` problems, reasoning-gym's
procedural datasets, an environment's seeds (`env`), a verifiers environment's rows
(`verifiers`, scored by its rubric), or rows read from JSONL/Parquet files or a Hugging
Face dataset, scored by a reward function (`reward.type=function`; looprl/rewards has
the others).
"""

from __future__ import annotations

from dataclasses import dataclass

from looprl.config import TaskConfig
from looprl.rewards import RewardFn
from looprl.workflows.imports import import_object


@dataclass
class Task:
    """A task's rows and how they are scored. `reward_fn` is None for tasks whose
    workflow scores them itself (`env`: the environment's rewards; `verifiers`: the
    environment's rubric); `scored_by` then says what does, for the error a reward
    function asked of it raises."""

    train: list[dict]
    eval: list[dict]
    reward_fn: RewardFn | None
    prompt_field: str
    system_prompt: str | None
    answer_field: str = "answer"
    scored_by: str = ""


def load_task(cfg: TaskConfig) -> Task:
    from looprl.tasks import arithmetic, datasets

    if cfg.name == "arithmetic":
        train, held_out = arithmetic.make_splits(cfg)
        return Task(train, held_out, arithmetic.arithmetic_reward, "question", cfg.system_prompt)
    if cfg.name == "env":
        from looprl.tasks import env_seeds

        train, held_out = env_seeds.make_splits(cfg)
        scored_by = "env.name's rewards, played by looprl.workflows:EnvWorkflow"
        return Task(train, held_out, None, "seed", cfg.system_prompt, scored_by=scored_by)
    if cfg.name == "verifiers":
        from looprl.workflows import verifiers

        train, held_out = verifiers.make_splits(cfg)
        scored_by = "the environment's rubric, in looprl.workflows:VerifiersWorkflow"
        return Task(train, held_out, None, "prompt", cfg.system_prompt, scored_by=scored_by)
    if cfg.name == "reasoning_gym":
        from looprl.tasks import reasoning_gym

        train, held_out, reward_fn = reasoning_gym.make_splits(cfg)
        return Task(train, held_out, reward_fn, "question", cfg.system_prompt)
    if cfg.train_path is None:
        raise ValueError(f"task.name={cfg.name!r} needs task.train_path")
    train = datasets.load_rows(cfg.train_path, cfg.name, cfg)
    held_out = (
        datasets.load_rows(cfg.eval_path, cfg.name, cfg, "task.eval_path") if cfg.eval_path else []
    )
    reward_fn = import_object(cfg.reward, "task.reward")
    return Task(train, held_out, reward_fn, cfg.prompt_field, cfg.system_prompt, cfg.answer_field)
