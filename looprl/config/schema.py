"""Config: every section in one model, the validators across sections (bodies in
validation.py), the run directory and writing the resolved config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, model_validator

from looprl.config import validation
from looprl.config.base import Section
from looprl.config.engine import EngineConfig
from looprl.config.gateway import GatewayConfig, SamplingConfig
from looprl.config.model import ModelConfig
from looprl.config.reward import RewardConfig
from looprl.config.rollout import RolloutConfig
from looprl.config.run import (
    CheckpointConfig,
    DiagnosticsConfig,
    MetricsConfig,
    RecoverConfig,
    RunConfig,
    SchedulerConfig,
)
from looprl.config.task import EnvConfig, TaskConfig
from looprl.config.train import EvalConfig, SftConfig, TrainConfig
from looprl.config.workflow import WorkflowConfig
from looprl.runs.paths import RunPaths


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
        return validation.apply_env_name(data)

    @model_validator(mode="after")
    def _sections_agree(self) -> Config:
        validation.check(self)
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.fileroot) / self.run.experiment_name / self.run.trial_name

    def save(self, run: RunPaths | Path | None = None) -> Path:
        """Write the resolved config into the run directory `run` (its RunPaths or its
        root; by default `run_dir`) as its config file."""
        path = RunPaths.of(run or self.run_dir).config
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_yaml())
        return path

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
