"""run, metrics, checkpoint, recover, diagnostics and scheduler: where a run lives,
what it records, how it resumes and how its processes are placed."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from looprl.config.base import Section


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


class RunConfig(Section):
    fileroot: str = Field("runs", description="Root folder of run directories.")
    experiment_name: str = Field("default", description="Run dir: fileroot/experiment/trial.")
    trial_name: str = Field("trial0", description="Run dir: fileroot/experiment/trial.")
    seed: int = Field(0, description="Seed for torch, sampling and data order.")
    log_level: Literal["DEBUG", "INFO", "WARNING"] = Field("INFO", description="Log level.")
    device: str = Field(
        "auto",
        description="Where the local engine, the trainer and its reference/teacher models "
        "run: auto (the first CUDA device torch sees, else the CPU), cpu, cuda or cuda:N. "
        "Decided once at start-up, which logs it; a vLLM/SGLang server launched here uses "
        "the GPUs whatever this says.",
    )

    @field_validator("device")
    @classmethod
    def _a_device_torch_names(cls, value: str) -> str:
        kind, _, index = value.partition(":")
        if value in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
            return value
        raise ValueError(f"run.device={value!r} must be auto, cpu, cuda or cuda:N (e.g. cuda:1)")

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
    keep_last: int = Field(
        1,
        ge=1,
        description="Recover checkpoints kept on disk while the run goes on, newest first "
        "(each holds the weights and optimizer state: 1.6 GB for SmolLM2-135M); an older one "
        "is removed only once a newer one is whole. 2 keeps one to fall back on if the "
        "newest is damaged.",
    )
    keep_on_finish: bool = Field(
        False,
        description="Keep the recover checkpoints when the run finishes (its model, metrics, "
        "plot and trajectories are kept either way), the last step's included, e.g. to "
        "continue the trial later with a larger train.total_steps. A run cut short (signal, "
        "crash) always keeps its newest.",
    )


class RecoverConfig(Section):
    mode: Literal["auto", "off", "require"] = Field(
        "auto",
        description="auto: resume from the newest valid checkpoint of this experiment and "
        "trial if there is one (a finished trial, its model there and no checkpoint, is "
        "refused rather than trained over); off: start fresh (checkpoints are still saved "
        "while running, so a run cut short can resume with auto); require: fail if there "
        "is none.",
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

    collapse_entropy: float = Field(
        0.05,
        ge=0,
        description="Warn when a training step's sampled tokens have a mean entropy below "
        "this (nats per token): the policy is collapsing onto one reply; 0 never warns.",
    )
    collapse_action_share: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Multi-turn runs: warn when one action (a reply's first word) takes "
        "at least this share of a step's replies; 1 warns only when every reply is one.",
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
