"""workflow: the agent a rollout runs, and the workflows that play env.name by default."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from looprl.config.base import Section

ENV_WORKFLOW = "looprl.workflows:EnvWorkflow"  # what plays env.name, unless workflow.path says
VERIFIERS_WORKFLOW = "looprl.workflows:VerifiersWorkflow"  # what plays task.name=verifiers
# What workflow.mode=subprocess sets for each rollout (looprl/workflows/agent_process.py).
AGENT_VARIABLES = (
    "OPENAI_BASE_URL",
    "OPENAI_API_KEY",
    "OPENAI_MODEL",
    "ANTHROPIC_BASE_URL",
    "ANTHROPIC_API_KEY",
    "LOOPRL_REWARD_URL",
    "LOOPRL_REWARD_KEY",
    "LOOPRL_DATA",
)
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class WorkflowConfig(Section):
    mode: Literal["python", "subprocess"] = Field(
        "python",
        description="'python': the workflow at workflow.path runs in this process; "
        "'subprocess': workflow.command runs once per rollout (any language), reads "
        "OPENAI_BASE_URL / OPENAI_API_KEY / LOOPRL_DATA and posts its reward to "
        "LOOPRL_REWARD_URL with LOOPRL_REWARD_KEY. The reward key is the agent's own: "
        "whatever holds it can set the rollout's reward, so an agent that runs the "
        "model's tool calls must run them without it (drop it from its environment "
        "first, and run them in a sandbox with no route to the gateway); OPENAI_API_KEY "
        "calls the model but cannot post a reward.",
    )
    path: str = Field(
        "looprl.workflows:RLVRWorkflow",
        description="The agent: 'module:Name' of a Workflow class, instance or async function.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the workflow class (subprocess: for "
        "looprl.workflows.agent_process.AgentProcess: env (variables and values of your "
        "own for the agent), cwd, kill_grace_s).",
    )
    command: str | list[str] | None = Field(
        None,
        description="subprocess: the agent's command line, a string (split like a shell "
        "does) or a list of arguments.",
    )
    env_passthrough: list[str] = Field(
        default_factory=list,
        description="subprocess: names of variables of looprl's environment that the agent "
        "command also gets, e.g. [E2B_API_KEY] (names only; each value is read when the "
        "rollout starts, and a name that is not set is left out). Of looprl's environment "
        "it otherwise gets only PATH, HOME, LANG, LC_*, TMPDIR and PYTHONPATH, so the "
        "run's tracker, hub and engine keys (WANDB_API_KEY, HF_TOKEN, OPENAI_API_KEY, ...) "
        "stay out of the agent and of whatever it runs for the model. Values of your "
        "own: workflow.kwargs.env.",
    )

    @field_validator("env_passthrough")
    @classmethod
    def _names_of_variables(cls, names: list[str]) -> list[str]:
        for name in names:
            if not _VARIABLE_NAME.fullmatch(name):
                raise ValueError(
                    f"workflow.env_passthrough: {name!r} is not an environment variable "
                    "name (letters, digits and _, not starting with a digit)"
                )
            if name in AGENT_VARIABLES:
                raise ValueError(
                    f"workflow.env_passthrough: {name} is set by looprl for each rollout "
                    "(the session's); remove it"
                )
        return names

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
        if self.mode == "python" and self.env_passthrough:
            raise ValueError(
                f"workflow.env_passthrough={self.env_passthrough} is only used with "
                "workflow.mode=subprocess (a Python workflow runs in looprl's process, with "
                "its environment); remove it"
            )
        # Against the default, not "was it set": a saved config spells every field out.
        if self.mode == "subprocess" and self.path != type(self).model_fields["path"].default:
            raise ValueError(
                f"workflow.path={self.path!r} is not used with workflow.mode=subprocess "
                "(the agent is workflow.command); remove one of them"
            )
        return self
