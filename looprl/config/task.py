"""task: the rows a run plays (built-in, files, reasoning-gym, verifiers, env seeds);
env: the environment played on seeds."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from looprl.config.base import Section

TaskName = Literal["arithmetic", "jsonl", "parquet", "hf", "reasoning_gym", "env", "verifiers"]


class TaskConfig(Section):
    name: TaskName = Field(
        "arithmetic",
        description="Built-in task, a dataset read from files, 'reasoning_gym': one of "
        "reasoning-gym's procedural datasets (task.dataset), scored by its own verifier, "
        "'env': episodes of env.name, one row per seed (train seeds task.seed x 2,000,000 + "
        "i, held-out ones 1,000,000 above them: unseen seeds; sizes task.train_size and "
        "task.eval_size); the default when env.name is set, or 'verifiers': the rows of the "
        "verifiers environment task.dataset (its dataset, and its eval_dataset held out), "
        "played and scored by the environment itself (what env.name=verifiers:ID sets).",
    )
    dataset: str | None = Field(
        None,
        description="reasoning_gym: the dataset's name, e.g. basic_arithmetic or "
        "leg_counting; verifiers: the environment's id (the module verifiers imports).",
    )
    dataset_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="reasoning_gym: keyword arguments for the dataset's config, e.g. "
        "{min_animals: 1, max_animals: 3} for leg_counting; verifiers: keyword arguments "
        "for the environment's load_environment.",
    )
    answer_format: Literal["tags", "last_line", "last_number"] = Field(
        "last_number",
        description="reasoning_gym: where the answer is in the completion: 'tags' the text "
        "in the last <answer>...</answer> (what reasoning-gym's prompts ask for), "
        "'last_line' the last non-empty line, 'last_number' the last number written.",
    )
    digits: int = Field(1, ge=1, le=6, description="arithmetic: digits per operand.")
    operators: list[Literal["+", "-", "*"]] = Field(
        ["+", "*"], description="arithmetic: operators to draw from."
    )
    train_size: int = Field(
        5000, ge=1, description="arithmetic, reasoning_gym: problems in the train split."
    )
    eval_size: int = Field(
        200,
        ge=1,
        description="arithmetic, reasoning_gym, verifiers: problems in the held-out split.",
    )
    train_path: str | None = Field(
        None,
        description="jsonl/parquet: training file; "
        "hf: dataset name on disk or in the local HF cache.",
    )
    eval_path: str | None = Field(None, description="jsonl/parquet: held-out file.")
    prompt_field: str = Field("question", description="Row field holding the prompt.")
    answer_field: str = Field("answer", description="Row field holding the reference answer.")
    reward: str = Field(
        "looprl.tasks.math_answer:math_reward",
        description="Reward function "
        "'module:name' for file datasets, called reward_fn(prompt, completion, "
        "**row) (with reward.type=function, the default).",
    )
    system_prompt: str | None = Field(
        None,
        description="System message prepended to each "
        "prompt; None keeps the chat template's default.",
    )
    seed: int = Field(
        0,
        description="Seed for generated problems and shuffling (reasoning_gym: the train "
        "split's; the held-out split is drawn with seed + 1).",
    )

    @model_validator(mode="after")
    def _dataset_goes_with_reasoning_gym(self) -> TaskConfig:
        if self.name == "reasoning_gym" and not self.dataset:
            raise ValueError(
                "task.name=reasoning_gym needs task.dataset, e.g. task.dataset=leg_counting"
            )
        if self.name == "verifiers" and not self.dataset:
            raise ValueError(
                "task.name=verifiers needs the environment's id in task.dataset; or set "
                "env.name=verifiers:ID"
            )
        if self.name not in ("reasoning_gym", "verifiers") and (
            self.dataset or self.dataset_kwargs
        ):
            raise ValueError(
                f"task.dataset={self.dataset!r} / task.dataset_kwargs are read by "
                f"task.name=reasoning_gym and verifiers only, not {self.name}; remove them"
            )
        return self


class EnvConfig(Section):
    """An environment played by looprl.workflows:EnvWorkflow (looprl/envs/): each turn its
    observation is the user's message and the model's reply its action."""

    name: str | None = Field(
        None,
        description="'gymnasium:ID' (e.g. gymnasium:FrozenLake-v1), 'textarena:ID' (e.g. "
        "textarena:GuessTheNumber-v0) or 'package.module:factory' for your own env (an "
        "object with reset(seed, options) -> text and step(text) -> (text, reward, done, "
        "info)). Setting it makes task.name=env and workflow.path=looprl.workflows:EnvWorkflow "
        "the defaults. 'verifiers:ID' (a verifiers environment, which plays its own "
        "rollouts) stands for task.name=verifiers task.dataset=ID task.dataset_kwargs="
        "<env.kwargs> and workflow.path=looprl.workflows:VerifiersWorkflow.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the env (gymnasium: for gymnasium.make, plus "
        "FrozenLake's random_map_size: a new N x N map per seed).",
    )
    max_turns: int = Field(
        16, ge=1, description="Most model replies per episode; the episode ends after them."
    )
    system_prompt: str | None = Field(
        None, description="System message of every turn; None keeps the chat template's."
    )
    history_turns: int = Field(
        0,
        ge=0,
        description="Earlier turns (observation and reply) kept in the prompt before the "
        "current observation; 0: the current observation only.",
    )
    discount: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Each reply is credited its return-to-go: its step's reward plus "
        "discount x the next reply's return-to-go.",
    )
    invalid_action_reward: float = Field(
        0.0,
        description="Reward of a reply the env rejects (InvalidAction); its message, then "
        "the unchanged observation, is the next turn's prompt.",
    )
    end_on_invalid_action: bool = Field(
        False, description="End the episode at the first reply the env rejects."
    )
    workers: int = Field(
        2,
        ge=1,
        description="Worker processes the envs run in (each holds many episodes and serves "
        "one call at a time).",
    )
    step_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A reset or step running longer ends its episode (EnvTimedOut); its "
        "worker is killed and replaced.",
    )
    frames_every: int = Field(
        0,
        ge=0,
        description="Save what the env showed (its frame at reset and after each step, as "
        "an animated GIF RUN_DIR/frames/<session_id>.gif, the session_id of the episode's "
        "rows in the trajectory files) for one episode in every N this run plays, "
        "held-out ones included; 0: none. The env is built with render_mode='rgb_array' "
        "(Gymnasium's convention) and MUJOCO_GL is picked as `looprl doctor` shows unless "
        "set; a render that fails is logged with doctor's diagnosis and the episodes go "
        "on without frames.",
    )
    frames_max_per_episode: int = Field(
        100,
        ge=2,
        description="Most frames kept of a saved episode: past it the step between kept "
        "frames doubles (every other one is dropped), so a long episode is shown whole, "
        "its last frame last; frames are downscaled to at most 240 pixels a side.",
    )
