"""The start-up phase: what every command needs, decided once and handed down.

`start(cfg)` resolves, before anything starts, what the rest of a run would otherwise
work out again in each part:

- the models: the policy (`model.path`: folders, config, tokenizer, context length, a
  LoRA adapter's base), the distillation teacher, and the judge where this run serves
  one (`ModelFiles`, models.py);
- where each part runs and in what precision: the device of the engine and the trainer,
  and the engine's dtype and weight layout and the trainer's compute dtype
  (`Precision`), decided from `precision.probe` on that device; a setting this machine
  cannot run fails here, naming the field;
- the run directory's paths (`RunPaths`, runs/paths.py).

The `Setup` it returns is what `looprl train`, `sft`, `rollout`, `serve`,
`debug consistency` and the judge's engine receive, and what the Ray actors are
started with; nothing below it sees `auto` or resolves a model path again. A command's
workflow and reward are opened through `Setup.open_workflow(task)`, an async context
that opens the reward (serving the judge where it needs a local engine), builds the
workflow on it, and closes both.

Devices: `run.device` (auto: the first CUDA device torch sees, else the CPU) is decided
here, in `decide_device`, from the CUDA devices torch lists; the local engine, the
trainer, its reference and teacher models and the judge's engine run there, and the
precision of each is decided for that device. A vLLM/SGLang server this run launches
runs on the GPUs when there are any (its precision is decided for them). Under Ray, an
actor given GPUs runs on its GPU (`Setup.on_gpu`, decided in the driver from a probe of
one of the cluster's GPUs).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from looprl import extras, memory, precision
from looprl.config import Config, EngineConfig
from looprl.engines.local.engine import LocalEngine
from looprl.engines.local.fused import unsupported_reason
from looprl.memory import MemoryPlan, ModelSizes, configured, device_memory
from looprl.models import ModelFiles, resolve_model
from looprl.precision import EnginePrecision, Precision, Probe, TrainPrecision
from looprl.rewards import needs_judge_engine
from looprl.runs.paths import RunPaths
from looprl.workflows.resolution import OpenedWorkflow, open_workflow, uses_configured_reward

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalModel:
    """A model served on a local engine: its files and the engine precision decided for
    it (the judge's engine, `looprl serve`)."""

    files: ModelFiles
    precision: EnginePrecision
    device: torch.device

    def engine(self, cfg: EngineConfig | None = None) -> LocalEngine:
        """A local engine on this model (float32 weights loaded on `device`, copied
        into the decided precision), with `cfg`'s batching limits."""
        model = self.files.load().to(self.device)
        return LocalEngine.for_model(
            model, self.files.tokenizer, cfg or EngineConfig(), self.precision
        )


@dataclass(frozen=True)
class Setup:
    """What start-up decided for one command (see the module docstring)."""

    cfg: Config
    model: ModelFiles
    device: torch.device  # where the engine (local) and the trainer run
    precision: Precision
    paths: RunPaths
    memory: MemoryPlan  # tokens per micro-batch, engine K/V tokens (looprl/memory.py)
    teacher: ModelFiles | None = None
    judge: LocalModel | None = None

    @asynccontextmanager
    async def open_workflow(self, task: Any) -> AsyncIterator[OpenedWorkflow]:
        """The configured reward and workflow for `task`, open while the context is."""
        async with open_workflow(
            self.cfg, task, frames_dir=self.paths.frames, judge=self.judge
        ) as opened:
            yield opened

    def on_gpu(self, found: Probe) -> Setup:
        """This setup for parts placed on a GPU (Ray actors given one), decided from
        `found`, a probe of such a GPU."""
        decided = Precision(
            _engine_precision(self.cfg.engine, self.model, found),
            _train_precision(self.cfg, found),
        )
        log.info("On the GPUs (%s): %s", found.capability, decided.line())
        budgets = _configured(self.cfg, "Ray actors: the configured budgets")
        return replace(self, device=torch.device("cuda", 0), precision=decided, memory=budgets)


def start(cfg: Config, *, train: bool = True) -> Setup:
    """Resolve `cfg` for a command: models, device, precision, run paths. `train`: the
    command trains (a teacher is loaded for train.algorithm=distill). Raises for a model
    that is not there, a setting whose extra is not installed or a precision this machine
    cannot run, before anything starts."""
    extras.check_installed(cfg)
    model = resolve_model(cfg.model.path)
    model.tokenizer  # noqa: B018 (read now: a folder without one fails at start-up)
    gpus = cuda_devices()
    device, why = decide_device(cfg.run.device, gpus)
    engine_device = device
    if cfg.engine.type != "local" and gpus:
        engine_device = torch.device("cuda", 0)  # a vLLM/SGLang server launched here: the GPUs
    decided = choose(cfg, model, engine_device, device)
    teacher = None
    if train and cfg.train.teacher_path:
        teacher = resolve_model(cfg.train.teacher_path)
    judge = None
    if needs_judge_engine(cfg) and uses_configured_reward(cfg):
        judge = serve_on_local_engine(cfg.reward.judge.model, EngineConfig(), cfg.run.device)
    plan = _memory_plan(cfg, model, device, decided, train=train)
    setup = Setup(cfg, model, device, decided, RunPaths(cfg.run_dir), plan, teacher, judge)
    log.info("%s (%s)", describe(setup, train=train), why)
    log.info("%s", plan.describe())
    return setup


def choose(
    cfg: Config, model: ModelFiles, engine_device: torch.device, train_device: torch.device
) -> Precision:
    """The precision of each part, the one place it is chosen: the engine's (dtype,
    weight layout) for `engine_device` and the trainer's (compute dtype) for
    `train_device`, each from `precision.probe` of that device at the model's layer
    shape. Raises PrecisionError for a setting that cannot run there."""
    shape = precision.layer_shape(model.config)
    return Precision(
        _engine_precision(cfg.engine, model, precision.probe(engine_device, *shape)),
        _train_precision(cfg, precision.probe(train_device, *shape)),
    )


async def on_ray_gpu(setup: Setup) -> Setup:
    """`setup` for Ray actors placed on GPUs: decided from a probe of one of the
    cluster's GPUs, taken by a one-GPU Ray task (the driver may have none)."""
    import ray

    shape = precision.layer_shape(setup.model.config)
    task = ray.remote(num_gpus=1, num_cpus=0)(precision.probe)
    return setup.on_gpu(await task.remote("cuda", *shape))


def serve_on_local_engine(spec: str, engine: EngineConfig, device: str = "auto") -> LocalModel:
    """The model `spec` resolved, and the device (`device`: a run.device setting) and
    precision of a local engine serving it under `engine`'s settings (the judge's
    engine; `looprl serve`)."""
    files, (device, _) = resolve_model(spec), decide_device(device, cuda_devices())
    files.tokenizer  # noqa: B018 (read now: a folder without one fails here)
    found = precision.probe(device, *precision.layer_shape(files.config))
    decided = _engine_precision(engine.model_copy(update={"type": "local"}), files, found)
    log.info("Serving %s on %s: %s", files.name, device, decided.describe())
    return LocalModel(files, decided, device)


def _memory_plan(
    cfg: Config, model: ModelFiles, device: torch.device, decided: Precision, *, train: bool
) -> MemoryPlan:
    """The memory plan on a GPU (looprl/memory.py); elsewhere the configured budgets."""
    found = device_memory(device)
    if found is None:
        return _configured(cfg, f"{device}: the configured budgets")
    train_uses = train and cfg.train.kl_coef > 0 and not cfg.model.lora.enabled
    extra = int(train_uses) + int(train and bool(cfg.train.teacher_path))
    return memory.plan(
        total=found.total,
        free=found.free,
        sizes=ModelSizes.of(model.config),
        master=cfg.model.dtype,
        compute=decided.train.dtype,
        autocast=decided.train.autocast,
        lora=cfg.model.lora.enabled,
        extra_models=extra,
        engine_dtype=decided.engine.dtype if cfg.engine.type == "local" else None,
        checkpointing=cfg.train.activation_checkpointing,
        train=train,
        train_tokens=cfg.train.max_tokens_per_mb,
        engine_cap=cfg.engine.max_tokens_per_batch,
        engine_fraction=cfg.engine.memory_fraction,
        device=str(device),
    )


def _configured(cfg: Config, why: str) -> MemoryPlan:
    return configured(cfg.train.max_tokens_per_mb, cfg.engine.max_tokens_per_batch, why)


def cuda_devices() -> list[str]:
    """The names of the CUDA devices torch sees here, by index (none without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def decide_device(setting: str, cuda: list[str]) -> tuple[torch.device, str]:
    """The device for `setting` (a run.device value: auto, cpu, cuda, cuda:N) on a machine
    whose CUDA devices are named `cuda` (by index), and why. Raises ValueError for a
    CUDA device that is not there, naming those that are."""
    if setting == "cpu":
        return torch.device("cpu"), "run.device=cpu"
    if setting == "auto":
        if not cuda:
            return torch.device("cpu"), "run.device=auto: torch sees no CUDA device"
        others = f" (of {len(cuda)} visible)" if len(cuda) > 1 else ""
        return torch.device("cuda", 0), f"run.device=auto: the first CUDA device{others}"
    index = torch.device(setting).index or 0
    if not cuda:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        raise ValueError(
            f"run.device={setting}: torch sees no CUDA device here (torch {torch.__version__}, "
            f"{build}); set run.device=auto or cpu"
        )
    if index >= len(cuda):
        listed = ", ".join(f"cuda:{i} ({name})" for i, name in enumerate(cuda))
        raise ValueError(
            f"run.device={setting}: this machine has {len(cuda)} CUDA device(s): {listed}; "
            "set run.device to one of them, or auto"
        )
    return torch.device("cuda", index), f"run.device={setting}"


def describe(setup: Setup, *, train: bool = True) -> str:
    """The start-up log line: what runs where, in what precision, and why. Without
    `train` (`looprl rollout`, `debug workflow`) it names neither the trainer nor the run
    dir, which such a command does not create."""
    adapter = f", LoRA adapter {setup.model.adapter}" if setup.model.adapter else ""
    engine = f"Precision: {setup.precision.engine.describe()}"
    precision = setup.precision.line() if train else engine
    return (
        f"Start-up: model {setup.model.name} ({setup.model.context_length} tokens of "
        f"context{adapter}); {placement(setup.cfg, setup.device, train=train)}; {precision}"
        + (f"; run dir {setup.paths.root}" if train else "")
    )


def placement(cfg: Config, device: torch.device, *, train: bool = True) -> str:
    """Which part runs where: 'engine (local) and trainer on cuda:0 (NVIDIA H100 80GB HBM3)'."""
    where = describe_device(device)
    trainer = " and trainer" if train else ""
    if cfg.engine.type == "local":
        return f"engine (local){trainer} on {where}"
    server = "its server's devices" if cfg.engine.url else "the server it launches"
    return f"engine ({cfg.engine.type}) on {server}" + (f", trainer on {where}" if train else "")


def describe_device(device: torch.device) -> str:
    """'cuda:0 (NVIDIA H100 80GB HBM3)', or the CPU's kind and flags."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({precision.cpu().describe()})"


def _engine_precision(cfg: EngineConfig, model: ModelFiles, found: Probe) -> EnginePrecision:
    """The engine's dtype and weight layout; a local engine whose model the fused
    forward cannot run (engine.impl=hf, or an unsupported architecture) takes plain
    weights under weight_layout=auto, and refuses packed ones."""
    decided = precision.engine_precision(cfg, found)
    if cfg.type != "local":
        return _warned(decided)
    hf_forward = "engine.impl=hf" if cfg.impl == "hf" else unsupported_reason(model.config)
    if hf_forward and cfg.impl == "fused":
        raise ValueError(f"engine.impl=fused cannot run {model.name}: {hf_forward}")
    if hf_forward and decided.weight_layout == "packed":
        if cfg.weight_layout == "packed":
            raise precision.PrecisionError(
                "engine.weight_layout=packed applies to the fused forward, and this engine "
                f"runs the Hugging Face one ({hf_forward}); set engine.weight_layout=auto"
            )
        decided = replace(decided, weight_layout="plain", reason=f"{decided.reason}; "
                          f"plain weights: the Hugging Face forward ({hf_forward})")  # fmt: skip
    return _warned(decided)


def _train_precision(cfg: Config, found: Probe) -> TrainPrecision:
    return _warned(precision.decide_train(cfg.train.compute_dtype, cfg.model.dtype, found))


def _warned(decided):
    if decided.warning:
        precision.warn_once(decided.warning)
    return decided
