"""workflow: the agent a rollout runs, and the workflows that play env.name by default."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from looprl.config.base import Section

ENV_WORKFLOW = "looprl.workflows:EnvWorkflow"  # what plays env.name, unless workflow.path says
VERIFIERS_WORKFLOW = "looprl.workflows:VerifiersWorkflow"  # what plays task.name=verifiers


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
