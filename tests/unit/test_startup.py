"""The start-up phase (looprl/startup.py): decided once, with nothing left at `auto`, and
the parts refuse to decide for themselves."""

import pickle
import shutil

import pytest
import torch

from looprl import startup
from looprl.config import TrainConfig, load_config
from looprl.engines.local.engine import LocalEngine
from looprl.models import load_model
from looprl.precision import PrecisionError, Probe
from looprl.runs.paths import RunPaths
from looprl.training.trainer import Trainer


def _config(model_dir, tmp_path, *overrides: str):
    return load_config(None, [f"model.path={model_dir}", f"run.fileroot={tmp_path}", *overrides])


def test_start_resolves_every_auto_once(tiny_model_dir, tmp_path, caplog):
    cfg = _config(tiny_model_dir, tmp_path)
    assert (cfg.engine.dtype, cfg.engine.weight_layout, cfg.train.compute_dtype) == ("auto",) * 3
    with caplog.at_level("INFO", logger="looprl.startup"):
        setup = startup.start(cfg)
    engine, train = setup.precision.engine, setup.precision.train
    assert engine.dtype in ("float32", "bfloat16") and engine.weight_layout in ("packed", "plain")
    assert train.dtype in ("float32", "bfloat16") and train.autocast == (train.dtype == "bfloat16")
    assert setup.device == torch.device("cpu")
    assert setup.paths == RunPaths(cfg.run_dir)
    assert setup.model.folder == tiny_model_dir and setup.model.adapter is None
    assert setup.model.context_length == setup.model.config.max_position_embeddings
    assert setup.teacher is None and setup.judge is None
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Start-up")]
    assert "engine (local) and trainer on cpu" in line
    assert f"engine {engine.dtype}, {engine.weight_layout} weights" in line
    assert str(cfg.run_dir) in line


def test_explicit_settings_are_kept_and_impossible_ones_fail_at_start(tiny_model_dir, tmp_path):
    setup = startup.start(
        _config(
            tiny_model_dir,
            tmp_path,
            "engine.dtype=float32",
            "engine.weight_layout=plain",
            "train.compute_dtype=float32",
        )
    )
    assert (setup.precision.engine.dtype, setup.precision.engine.weight_layout) == (
        "float32",
        "plain",
    )
    assert (setup.precision.train.dtype, setup.precision.train.autocast) == ("float32", False)
    # The Hugging Face forward has no packed weights: refused before anything loads...
    with pytest.raises(PrecisionError, match="engine.weight_layout=packed applies to the fused"):
        startup.start(
            _config(tiny_model_dir, tmp_path, "engine.impl=hf", "engine.weight_layout=packed")
        )
    # ...and under auto the layout follows the forward that will run.
    hf = startup.start(_config(tiny_model_dir, tmp_path, "engine.impl=hf"))
    assert hf.precision.engine.weight_layout == "plain"


def test_a_model_folder_without_a_tokenizer_fails_at_start(tiny_model_dir, tmp_path):
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, weights_only / name)
    assert load_model(weights_only) is not None  # loading weights alone needs no tokenizer
    with pytest.raises((OSError, ValueError)):
        startup.start(_config(weights_only, tmp_path))


def test_a_setup_travels_to_an_actor_whole(tiny_model_dir, tmp_path):
    """Ray actors are started with the Setup: it pickles with its decisions and its
    tokenizer, so an actor resolves nothing again."""
    setup = startup.start(_config(tiny_model_dir, tmp_path, "train.compute_dtype=float32"))
    copy = pickle.loads(pickle.dumps(setup))
    assert copy.precision == setup.precision and copy.paths == setup.paths
    assert copy.model.folder == setup.model.folder
    assert copy.model.tokenizer.encode("2 + 2") == setup.model.tokenizer.encode("2 + 2")


def test_on_a_gpu_the_decision_is_the_gpus(tiny_model_dir, tmp_path):
    """What Ray actors placed on GPUs get, from a probe of a GPU (here a stand-in probe:
    the decision is a pure function of it, run on this CPU)."""
    setup = startup.start(_config(tiny_model_dir, tmp_path))
    bf16_gpu = Probe("cuda", (256, 1024), "NVIDIA H100 80GB HBM3", cuda_bf16=True)
    on_gpu = setup.on_gpu(bf16_gpu)
    assert on_gpu.device == torch.device("cuda", 0)
    assert (on_gpu.precision.engine.dtype, on_gpu.precision.engine.weight_layout) == (
        "bfloat16",
        "plain",
    )
    assert (on_gpu.precision.train.dtype, on_gpu.precision.train.autocast) == ("bfloat16", True)
    assert not on_gpu.memory.replan  # Ray actors: the configured budgets, no GPU plan
    old_gpu = Probe("cuda", (256, 1024), "Tesla T4", cuda_bf16=False)
    assert setup.on_gpu(old_gpu).precision.engine.dtype == "float32"
    packed = startup.start(_config(tiny_model_dir, tmp_path, "engine.weight_layout=packed"))
    with pytest.raises(PrecisionError, match="oneDNN's CPU layout"):
        packed.on_gpu(bf16_gpu)


def test_the_parts_refuse_to_decide_auto_themselves(tiny_model_dir):
    tiny_model = load_model(tiny_model_dir)
    with pytest.raises(ValueError, match="train.compute_dtype=auto is decided at start-up"):
        Trainer(tiny_model, TrainConfig())
    with pytest.raises(ValueError, match="engine.dtype=auto is decided at start-up"):
        LocalEngine(tiny_model, eos_token_ids=[], dtype="auto")
    with pytest.raises(ValueError, match="engine.weight_layout=auto is decided at start-up"):
        LocalEngine(tiny_model, eos_token_ids=[], weight_layout="auto")
    # An explicit compute dtype is taken as it is, without asking the machine.
    trainer = Trainer(tiny_model, TrainConfig(compute_dtype="bfloat16"))
    assert (trainer.precision.dtype, trainer.precision.autocast) == ("bfloat16", True)


def test_a_teacher_is_resolved_only_for_training(tiny_model_dir, tmp_path):
    cfg = _config(
        tiny_model_dir,
        tmp_path,
        "train.algorithm=distill",
        f"train.teacher_path={tiny_model_dir}",
        "train.compute_dtype=float32",
    )
    assert startup.start(cfg).teacher.folder == tiny_model_dir
    assert startup.start(cfg, train=False).teacher is None


H100 = "NVIDIA H100 80GB HBM3"


def test_run_device_is_decided_from_the_devices_torch_lists():
    """decide_device is what start-up runs on `cuda_devices()`; here on named lists, so
    both sides of every branch run on this CPU."""
    assert startup.decide_device("auto", []) == (
        torch.device("cpu"),
        "run.device=auto: torch sees no CUDA device",
    )
    device, why = startup.decide_device("auto", [H100, H100])
    assert device == torch.device("cuda", 0) and why == (
        "run.device=auto: the first CUDA device (of 2 visible)"
    )
    assert startup.decide_device("cpu", [H100])[0] == torch.device("cpu")
    assert startup.decide_device("cuda", [H100])[0] == torch.device("cuda", 0)
    assert startup.decide_device("cuda:1", [H100, "NVIDIA A100"])[0] == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"run.device=cuda:7: this machine has 2 CUDA") as e:
        startup.decide_device("cuda:7", [H100, "NVIDIA A100"])
    assert f"cuda:0 ({H100}), cuda:1 (NVIDIA A100)" in str(e.value)
    with pytest.raises(ValueError, match="run.device=cuda: torch sees no CUDA device here"):
        startup.decide_device("cuda", [])


def test_a_run_device_that_is_not_there_fails_at_start(tiny_model_dir, tmp_path):
    # This machine's own list (the CI has no GPU): cuda:7 is past it either way.
    with pytest.raises(ValueError, match="run.device=cuda:7"):
        startup.start(_config(tiny_model_dir, tmp_path, "run.device=cuda:7"))
    with pytest.raises(ValueError, match="run.device='gpu' must be auto, cpu, cuda or cuda:N"):
        _config(tiny_model_dir, tmp_path, "run.device=gpu")
    setup = startup.start(_config(tiny_model_dir, tmp_path, "run.device=cpu"))
    assert setup.device == torch.device("cpu")
    budgets = setup.memory  # off a GPU: the configured budgets, 4096 for an unset one
    assert (budgets.train_tokens_per_mb, budgets.engine_kv_tokens) == (4096, 65536)
    assert not budgets.replan
    bigger = startup.start(
        _config(
            tiny_model_dir,
            tmp_path,
            "train.max_tokens_per_mb=512",
            "engine.max_tokens_per_batch=1024",
        )
    ).memory
    assert (bigger.train_tokens_per_mb, bigger.engine_kv_tokens) == (512, 1024)


def test_kernels_are_decided_with_the_device(tiny_model_dir, tmp_path):
    """auto: the cpu kernels on a CPU, the portable ones on a GPU; portable forced on a
    CPU takes plain weights; the cpu kernels on a GPU, or packed weights with portable
    kernels, fail at start naming the field."""
    assert startup.start(_config(tiny_model_dir, tmp_path)).precision.engine.kernels == "cpu"
    portable = startup.start(_config(tiny_model_dir, tmp_path, "engine.kernels=portable"))
    engine = portable.precision.engine
    assert (engine.kernels, engine.weight_layout) == ("portable", "plain")
    assert "portable kernels" in engine.describe()
    bf16_gpu = Probe("cuda", (256, 1024), H100, cuda_bf16=True)
    setup = startup.start(_config(tiny_model_dir, tmp_path))
    assert setup.on_gpu(bf16_gpu).precision.engine.kernels == "portable"
    forced = startup.start(_config(tiny_model_dir, tmp_path, "engine.kernels=cpu"))
    with pytest.raises(PrecisionError, match="engine.kernels=cpu are the CPU-tuned kernels"):
        forced.on_gpu(bf16_gpu)
    with pytest.raises(PrecisionError, match="engine.kernels=portable runs plain F.linear"):
        startup.start(
            _config(
                tiny_model_dir, tmp_path, "engine.kernels=portable", "engine.weight_layout=packed"
            )
        )
