"""Every check that reads more than one section: how env.name sets up task and workflow
(before validation), and what the validated sections must agree on (after it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from looprl.config.workflow import ENV_WORKFLOW, VERIFIERS_WORKFLOW, WorkflowConfig

if TYPE_CHECKING:
    from looprl.config.schema import Config


def apply_env_name(data: Any) -> Any:
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


def check(config: Config) -> None:
    """Raise ValueError at the first rule across sections that config breaks."""
    for rule in _RULES:
        rule(config)


def _env_plays_seeds(config: Config) -> None:
    if config.task.name == "env" and not config.env.name:
        raise ValueError(
            "task.name=env plays episodes of env.name, which is not set; e.g. "
            "env.name=gymnasium:FrozenLake-v1"
        )
    if config.env.name and config.task.name != "env":
        raise ValueError(
            f"env.name={config.env.name!r} is played on seeds (task.name=env), not on "
            f"task.name={config.task.name} rows; remove task.name or env.name"
        )
    rlvr = WorkflowConfig.model_fields["path"].default
    plays_rows = config.workflow.mode == "python" and config.workflow.path == rlvr
    if config.task.name == "env" and plays_rows:
        raise ValueError(
            f"task.name=env rows are seeds, which workflow.path={rlvr} cannot play; use "
            f"workflow.path={ENV_WORKFLOW} (the default with env.name) or your own"
        )
    if config.task.name == "verifiers" and plays_rows:
        raise ValueError(
            f"task.name=verifiers rows are played and scored by their environment, which "
            f"workflow.path={rlvr} cannot do; use workflow.path={VERIFIERS_WORKFLOW} (the "
            "default with env.name=verifiers:ID) or your own"
        )


def _bfloat16_weights_compute_in_bfloat16(config: Config) -> None:
    if config.model.dtype == "bfloat16" and config.train.compute_dtype == "float32":
        raise ValueError(
            "train.compute_dtype=float32 cannot compute in float32 with model.dtype="
            "bfloat16 master weights; set model.dtype=float32 or train.compute_dtype=auto"
        )


def _reward_scores_the_builtin_workflow(config: Config) -> None:
    workflow = config.workflow
    builtin = workflow.mode == "python" and workflow.path == "looprl.workflows:RLVRWorkflow"
    if config.reward.type != "function" and not builtin:
        raise ValueError(
            f"reward.type={config.reward.type} scores the built-in workflow's answers, but "
            f"workflow.{'path' if workflow.mode == 'python' else 'mode'} names your own "
            "agent, which returns its own reward; remove one of them (an agent can use "
            "looprl.rewards.code.CodeReward or looprl.rewards.judge.JudgeReward itself)"
        )


def _stale_tokens_are_corrected(config: Config) -> None:
    lag = config.rollout.max_head_offpolicyness
    if config.train.mismatch_correction == "none" and lag > 0:
        raise ValueError(
            f"train.mismatch_correction=none with rollout.max_head_offpolicyness={lag}: "
            "tokens sampled by older weights need the behavior weight pi_prox/pi_behav "
            "that corrects for them; use tis or mis, or max_head_offpolicyness=0"
        )


def _overlong_buffer_fits(config: Config) -> None:
    overlong = config.train.overlong
    limit = overlong.max_tokens or config.sampling.max_new_tokens
    if overlong.soft_penalty_buffer_tokens > limit:
        where = "train.overlong.max_tokens" if overlong.max_tokens else "sampling.max_new_tokens"
        raise ValueError(
            "train.overlong.soft_penalty_buffer_tokens="
            f"{overlong.soft_penalty_buffer_tokens} is longer than {where}={limit}: "
            "the penalty would start before the first token; lower it"
        )


def _slow_rollouts_are_no_hang(config: Config) -> None:
    hang_s, rollout_s = config.diagnostics.hang_timeout_s, config.rollout.timeout_s
    if 0 < hang_s <= rollout_s:
        raise ValueError(
            f"diagnostics.hang_timeout_s={hang_s:g} must be above rollout.timeout_s="
            f"{rollout_s:g}: a batch waiting on slow rollouts would be reported as a "
            "hang; raise diagnostics.hang_timeout_s (0 turns the watchdog off)"
        )


def _broadcast_reaches_local_engines_only(config: Config) -> None:
    if config.scheduler.weight_sync == "broadcast" and config.engine.type != "local":
        raise ValueError(
            f"scheduler.weight_sync=broadcast loads weights into local engines; "
            f"engine.type={config.engine.type} servers load weight folders: use "
            "scheduler.weight_sync=memory (or auto)"
        )
    if config.scheduler.weight_sync == "broadcast" and config.model.lora.enabled:
        raise ValueError(
            "scheduler.weight_sync=broadcast sends full weights; with model.lora the "
            "replicas get the adapter (megabytes) through the object store: use "
            "scheduler.weight_sync=memory (or auto)"
        )


def _one_process_runs_one_of_each(config: Config) -> None:
    sched = config.scheduler
    if sched.type == "ray":
        return
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


_RULES = (
    _env_plays_seeds,
    _bfloat16_weights_compute_in_bfloat16,
    _reward_scores_the_builtin_workflow,
    _stale_tokens_are_corrected,
    _overlong_buffer_fits,
    _slow_rollouts_are_no_hang,
    _broadcast_reaches_local_engines_only,
    _one_process_runs_one_of_each,
)
