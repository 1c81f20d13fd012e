"""reward: how the built-in workflow's answers are scored (function, code sandbox, judge)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from looprl.config.base import Section


class CodeRewardConfig(Section):
    """reward.type=code: the model's program runs with the row's tests in a sandbox
    (looprl/rewards/sandbox.py); the reward is the fraction of tests that pass."""

    tests_field: str = Field(
        "tests",
        description="Row field holding the tests: a list of snippets (e.g. assert "
        "statements), each run with the program in its own sandbox, or one test script.",
    )
    timeout_s: float = Field(
        10.0, gt=0, description="Wall-clock limit of one test run; beyond it, killed."
    )
    cpu_time_s: int = Field(5, ge=1, description="CPU-time limit of one test run (RLIMIT_CPU).")
    memory_mb: int = Field(
        1024, ge=64, description="Address-space limit of each process, in MiB (RLIMIT_AS)."
    )
    max_processes: int = Field(
        32,
        ge=1,
        description="Most processes the program may run at once (RLIMIT_NPROC inside its own "
        "user namespace); a fork bomb stops there.",
    )
    max_output_bytes: int = Field(
        1_000_000,
        ge=1024,
        description="Largest file the program may write, its output included (RLIMIT_FSIZE).",
    )
    max_concurrent: int = Field(2, ge=1, description="Sandboxes running at once, in all.")
    isolation: Literal["auto", "namespaces", "rlimits"] = Field(
        "auto",
        description="'namespaces': new user, network, PID and mount namespaces (no network, "
        "a read-only file system but the work dir, a process limit that holds for root); "
        "refuses to start where `unshare` cannot make them. 'rlimits': resource limits, a "
        "temporary work dir and a scrubbed environment only. 'auto': namespaces where the "
        "machine allows them, else rlimits with a warning.",
    )


class JudgeConfig(Section):
    """reward.type=judge: an LLM scores each answer through an OpenAI-compatible API."""

    model: str = Field(
        "default",
        description="Without base_url: the judge's model folder (or 'default'), served by a "
        "second local engine the run starts. With base_url: the model name the API serves.",
    )
    base_url: str | None = Field(
        None,
        description="An OpenAI-compatible endpoint (e.g. https://api.openai.com/v1); None "
        "serves reward.judge.model locally.",
    )
    api_key_env: str = Field(
        "OPENAI_API_KEY",
        description="Environment variable holding the API key for base_url (the key itself "
        "never goes into the config, which is saved in the run dir).",
    )
    mode: Literal["absolute", "group"] = Field(
        "absolute",
        description="'absolute': one call per rollout, a score 0-10 -> [0, 1]. 'group': one "
        "call per group scoring all its rollouts of a prompt together, one score per "
        "candidate (group-relative advantages only need their order).",
    )
    prompt: str = Field(
        "Rate the answer to the question from 0 (wrong or useless) to 10 (fully correct)."
        "\n\nQuestion:\n{question}\n\nReference answer:\n{reference}\n\nAnswer to "
        "rate:\n{answer}\n\nReply with the score only, as 'Score: N'.",
        description="absolute: the rubric, with {question}, {answer} and {reference}.",
    )
    group_prompt: str = Field(
        "Rate each candidate answer to the question from 0 (wrong or useless) to 10 (fully "
        "correct).\n\nQuestion:\n{question}\n\nReference answer:\n{reference}\n\n"
        "{candidates}\n\nReply with one line per candidate, as 'Candidate N: score'.",
        description="group: the rubric, with {question}, {reference} and {candidates} "
        "(numbered 'Candidate 1: ...' blocks).",
    )
    max_tokens: int = Field(64, ge=1, description="Most tokens of one judgment.")
    timeout_s: float = Field(60.0, gt=0, description="Limit of one judge call, in seconds.")
    retries: int = Field(
        2, ge=0, description="Calls retried after a failure or an unreadable reply."
    )
    backoff_s: float = Field(
        1.0, ge=0, description="Wait before retry k: backoff_s x 2 ** (k - 1) seconds."
    )
    fallback_reward: float | None = Field(
        0.0,
        description="Reward of a rollout whose judgment failed after every retry (counted as "
        "reward_judge_failures); None rejects the rollout instead.",
    )
    cache_size: int = Field(
        10_000, ge=0, description="Judgments kept by (prompt, completion) hash; 0: none."
    )

    @model_validator(mode="after")
    def _templates_fill(self) -> JudgeConfig:
        for name, fields in (
            ("prompt", ("question", "answer", "reference")),
            ("group_prompt", ("question", "reference", "candidates")),
        ):
            try:
                getattr(self, name).format(**dict.fromkeys(fields, ""))
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(
                    f"reward.judge.{name} cannot be filled in ({type(e).__name__}: {e}): it "
                    f"may use {', '.join('{' + f + '}' for f in fields)}; write a literal "
                    "brace as {{ or }}"
                ) from None
        return self


class RewardConfig(Section):
    type: Literal["function", "code", "judge"] = Field(
        "function",
        description="'function': the task's reward (task.reward for file datasets). 'code': "
        "run the model's program with the row's tests in a sandbox (reward.code). 'judge': "
        "an LLM judges the answer (reward.judge).",
    )
    code: CodeRewardConfig = Field(
        default_factory=CodeRewardConfig, description="reward.type=code: the sandbox and tests."
    )
    judge: JudgeConfig = Field(
        default_factory=JudgeConfig, description="reward.type=judge: the judge and its rubric."
    )
