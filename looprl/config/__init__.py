"""Typed configuration: one pydantic model per component, YAML + dotted overrides.

Owns: the schema (every field documented, unknown keys rejected), loading a YAML
file, applying `a.b.c=value` overrides, turning validation failures into one
readable error that names the field path and the value, and writing the resolved
config into the run directory. Does not own what any field does.

Modules: base (Section, ConfigError), model (model, model.lora), engine, gateway
(sampling, gateway, gateway.limits), task (task, env), reward (reward, reward.code,
reward.judge), workflow, rollout, train (train, train.overlong, eval, sft), run (run,
metrics, checkpoint, recover, diagnostics, scheduler), validation (every check across
sections), schema (Config), loading (load_config, error messages).
"""

from looprl.config.base import ConfigError, Section
from looprl.config.engine import EngineConfig
from looprl.config.gateway import GatewayConfig, LimitsConfig, SamplingConfig
from looprl.config.loading import load_config
from looprl.config.model import LoraConfig, ModelConfig
from looprl.config.reward import CodeRewardConfig, JudgeConfig, RewardConfig
from looprl.config.rollout import RolloutConfig
from looprl.config.run import (
    CheckpointConfig,
    DiagnosticsConfig,
    MetricsConfig,
    RecoverConfig,
    RunConfig,
    SchedulerConfig,
)
from looprl.config.schema import Config
from looprl.config.task import EnvConfig, TaskConfig, TaskName
from looprl.config.train import OBJECTIVE_CLIP, EvalConfig, OverlongConfig, SftConfig, TrainConfig
from looprl.config.workflow import ENV_WORKFLOW, VERIFIERS_WORKFLOW, WorkflowConfig

__all__ = [
    "ENV_WORKFLOW",
    "OBJECTIVE_CLIP",
    "VERIFIERS_WORKFLOW",
    "CheckpointConfig",
    "CodeRewardConfig",
    "Config",
    "ConfigError",
    "DiagnosticsConfig",
    "EngineConfig",
    "EnvConfig",
    "EvalConfig",
    "GatewayConfig",
    "JudgeConfig",
    "LimitsConfig",
    "LoraConfig",
    "MetricsConfig",
    "ModelConfig",
    "OverlongConfig",
    "RecoverConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingConfig",
    "SchedulerConfig",
    "Section",
    "SftConfig",
    "TaskConfig",
    "TaskName",
    "TrainConfig",
    "WorkflowConfig",
    "load_config",
]
