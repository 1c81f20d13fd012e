"""The SGLang engine adapter against a real loopback server speaking SGLang's protocol.

SGLang itself needs CUDA and cannot run here; `tests/support/sglang_protocol.py` serves a real
model over SGLang's documented HTTP API (it cites the files followed), and loads the
weight folders the adapter writes with `from_pretrained`, so a folder that is not a
complete model fails. Launching a real SGLang server is only checked up to its command
line (and the placement error on a GPU-less machine, tests/unit/test_engine_launch.py).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from looprl import adapters, startup
from looprl.config import Config, EngineConfig, LoraConfig, TrainConfig, load_config
from looprl.engines.base import EngineError, EngineRequestError, EngineUnavailable
from looprl.engines.launch import check_placement, start_engine
from looprl.engines.servers.client import ENGINE_KEY_VARIABLE
from looprl.engines.servers.sglang import (
    KEY_VARIABLE,
    LAUNCHER,
    SGLangEngine,
    sglang_command,
    sglang_env,
)
from looprl.models import load_model, load_tokenizer
from looprl.training.trainer import Trainer
from looprl.types import SamplingParams
from tests.support.sglang_protocol import sglang_protocol_server


@pytest.fixture
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


SERVER_KEY = "the-servers-key"


@pytest.fixture
def server(tiny_model_dir, monkeypatch):
    """The stand-in requires a key, as an SGLang server started with --api-key does;
    looprl finds it where a user puts the key of a server they started."""
    monkeypatch.setenv(ENGINE_KEY_VARIABLE, SERVER_KEY)
    with sglang_protocol_server(
        tiny_model_dir, seconds_per_token=0.01, api_key=SERVER_KEY
    ) as served:
        yield served


def _config(url: str, tmp_path, model_dir) -> Config:
    return load_config(
        None,
        [
            f"model.path={model_dir}",
            "engine.type=sglang",
            f"engine.url={url}",
            "engine.dtype=float32",
            f"run.fileroot={tmp_path}",
        ],
    )


@pytest.fixture
async def engine(server, model, tokenizer, tmp_path, tiny_model_dir):
    url, _, _ = server
    cfg = _config(url, tmp_path, tiny_model_dir)
    setup = startup.start(cfg, train=False)
    engine = await start_engine(setup, model, setup.paths)
    assert isinstance(engine, SGLangEngine)
    yield engine
    await engine.stop()


def _reference_logprobs(model, prompt: list[int], output: list[int], temperature: float):
    """What the trainer computes: log_softmax(logits / T) of each sampled token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return (logits / temperature).log_softmax(-1).gather(1, torch.tensor(output)[:, None])[:, 0]


def _prompt(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


async def test_connect_loads_the_policy_and_generates_ids_logprobs_versions(
    engine, server, model, tokenizer
):
    _, state, _ = server
    # connect pushed the policy's weights as version 0 through the weight folder
    assert state.weight_version == "0"
    assert state.model_path.endswith("weights/v000000")
    prompt = _prompt(tokenizer, "What is 2 + 3?")
    gen = await engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0.7))
    assert gen.prompt_ids == prompt
    assert len(gen.output_ids) == 12 and gen.finish_reason == "length"
    assert gen.versions == [0] * 12
    reference = _reference_logprobs(model, prompt, gen.output_ids, 0.7)
    assert torch.allclose(torch.tensor(gen.logprobs), reference, atol=1e-4)

    greedy = await engine.generate(
        prompt, SamplingParams(max_new_tokens=6, temperature=0.0, top_logprobs=3)
    )
    reference = _reference_logprobs(model, prompt, greedy.output_ids, 1.0)
    assert torch.allclose(torch.tensor(greedy.logprobs), reference, atol=1e-4)
    for token, logprob, top in zip(
        greedy.output_ids, greedy.logprobs, greedy.top_logprobs, strict=True
    ):
        assert len(top) == 3 and top[0] == (token, pytest.approx(logprob, abs=1e-6))


async def test_update_weights_goes_through_a_versioned_folder(engine, server, model, tokenizer):
    _, state, _ = server
    prompt = _prompt(tokenizer, "Name a colour.")
    before = await engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=1.0))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    await engine.update_weights(model.state_dict(), 1)

    assert engine.version == 1 and state.weight_version == "1"
    folder = state.model_path
    assert folder.endswith("weights/v000001")
    assert json.loads((Path(folder) / "version.json").read_text()) == {"version": 1}
    update = [body for path, body in state.calls if path == "/update_weights_from_disk"][-1]
    assert update["weight_version"] == "1" and update["flush_cache"] is True
    paths = [path for path, _ in state.calls]
    assert paths[-3:] == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]

    after = await engine.generate(
        before.prompt_ids, SamplingParams(max_new_tokens=8, temperature=1.0)
    )
    assert after.versions == [1] * len(after.output_ids)
    reference = _reference_logprobs(model, prompt, after.output_ids, 1.0)
    assert torch.allclose(torch.tensor(after.logprobs), reference, atol=1e-4)
    # the server really serves the new weights: the old tokens now score differently
    rescored = _reference_logprobs(model, prompt, before.output_ids, 1.0)
    assert (rescored - torch.tensor(before.logprobs)).abs().max() > 1e-3


async def test_a_lora_adapter_is_merged_into_the_base_folder_where_the_server_loads_no_adapters(
    engine, server, model, tokenizer
):
    """SGLang's engine has no adapter-loading calls here: the adapter is merged into the
    newest full version and loaded as a weight folder."""
    _, state, _ = server
    trainer = Trainer(load_model(model.name_or_path), TrainConfig(compute_dtype="float32"),
                      lora=LoraConfig(rank=4))  # fmt: skip
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    adapter = trainer.adapter_for_engine()
    await engine.update_adapter(adapter, 1)
    assert engine.version == 1 and state.model_path.endswith("weights/v000001")
    merged = load_model(model.name_or_path)
    merged.load_state_dict(adapters.merge(merged.state_dict(), adapter))
    prompt = _prompt(tokenizer, "Name a colour.")
    gen = await engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=1.0))
    reference = _reference_logprobs(merged, prompt, gen.output_ids, 1.0)
    assert torch.allclose(torch.tensor(gen.logprobs), reference, atol=1e-4)
    plain = _reference_logprobs(model, prompt, gen.output_ids, 1.0)
    assert not torch.allclose(torch.tensor(gen.logprobs), plain, atol=1e-2)


async def test_a_collocated_server_frees_its_memory_while_paused_and_takes_it_back_to_load(
    engine, server, model, tokenizer
):
    """What the Ray scheduler does around a collocated trainer's step: pause, release,
    (the trainer steps), load the new weights (memory taken back first), resume."""
    _, state, _ = server
    await engine.pause()
    await engine.release_memory()
    assert state.released
    await engine.update_weights(model.state_dict(), 1)
    await engine.resume()
    paths = [path for path, _ in state.calls]
    assert paths[-5:] == [
        "/pause_generation",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    prompt = _prompt(tokenizer, "Name a colour.")
    after = await engine.generate(prompt, SamplingParams(max_new_tokens=4, temperature=1.0))
    assert after.versions == [1] * len(after.output_ids)


async def test_release_memory_refuses_a_server_still_serving(engine):
    with pytest.raises(EngineError, match="paused first"):
        await engine.release_memory()


async def test_pause_drains_requests_in_flight_and_holds_new_ones(engine, server, model, tokenizer):
    _, state, _ = server
    prompt = _prompt(tokenizer, "Count to ten.")
    sampling = SamplingParams(max_new_tokens=30, temperature=1.0)
    in_flight = asyncio.create_task(engine.generate(prompt, sampling))
    while state.running == 0:
        await asyncio.sleep(0.005)
    await engine.pause()
    # pause returned only after the request in flight had finished, under version 0
    assert in_flight.done() and in_flight.result().versions == [0] * 30
    assert state.calls[-1] == ("/pause_generation", {"mode": "retract"})

    held = asyncio.create_task(engine.generate(prompt, sampling))
    await asyncio.sleep(0.2)
    assert not held.done() and state.running == 0  # waiting at the gate, not sent
    await engine.update_weights(model.state_dict(), 1)  # stays paused: pause was ours
    assert not held.done() and state.paused
    await engine.resume()
    gen = await asyncio.wait_for(held, 30)
    assert gen.versions == [1] * 30


async def test_stop_token_ids_and_stop_strings_end_with_the_stop_in_the_output(engine, tokenizer):
    prompt = _prompt(tokenizer, "Say something.")
    free = await engine.generate(prompt, SamplingParams(max_new_tokens=10, temperature=0.0))
    stop_id = free.output_ids[3]
    first = free.output_ids.index(stop_id)
    gen = await engine.generate(
        prompt, SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=[stop_id])
    )
    assert gen.finish_reason == "stop" and gen.output_ids == free.output_ids[: first + 1]

    text = tokenizer.decode(free.output_ids[:5])
    stop = text[-2:] if text[-2:].strip() else text[-3:]
    gen = await engine.generate(
        prompt, SamplingParams(max_new_tokens=10, temperature=0.0, stop=[stop])
    )
    assert gen.finish_reason == "stop" and stop in tokenizer.decode(gen.output_ids)


async def test_refuses_truncated_sampling_and_seeds_it_cannot_serve_exactly(engine, tokenizer):
    prompt = _prompt(tokenizer, "Hi")
    with pytest.raises(EngineRequestError, match=r"top_k=5.*before top-k/top-p truncation"):
        await engine.generate(prompt, SamplingParams(max_new_tokens=4, top_k=5))
    with pytest.raises(EngineRequestError, match=r"top_p=0.9"):
        await engine.generate(prompt, SamplingParams(max_new_tokens=4, top_p=0.9))
    with pytest.raises(EngineRequestError, match=r"seed=3.*rollout.seeded=false"):
        await engine.generate(prompt, SamplingParams(max_new_tokens=4, seed=3))
    # greedy ignores top-k/top-p, so nothing is truncated there
    gen = await engine.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0, top_k=5))
    assert len(gen.output_ids) == 4
    # as is a temperature below MIN_TEMPERATURE
    gen = await engine.generate(
        prompt, SamplingParams(max_new_tokens=4, temperature=1e-6, top_p=0.5)
    )
    assert len(gen.output_ids) == 4


async def test_a_server_that_is_gone_is_named_in_the_error(engine, server, tokenizer):
    url, _, uvicorn_server = server
    uvicorn_server.should_exit = True
    await asyncio.sleep(1.0)  # uvicorn checks should_exit every 0.1 s
    with pytest.raises(EngineUnavailable, match=rf"SGLang server at {url} could not be reached"):
        await engine.generate(_prompt(tokenizer, "Hi"), SamplingParams(max_new_tokens=2))


async def test_a_failed_weight_load_is_reported_with_the_server_message(engine, server, tmp_path):
    url, _, _ = server
    with pytest.raises(EngineError, match=r"answered POST /update_weights_from_disk with 400"):
        await engine.update_weights({"not.a.weight": torch.zeros(2)}, 5)
    assert engine.version == 0  # the failed version is not claimed


def test_launching_sglang_passes_options_through(tmp_path):
    # what a machine refuses (no GPU, too few GPUs): tests/unit/test_engine_launch.py
    cfg = EngineConfig(
        type="sglang",
        dtype="bfloat16",
        tensor_parallel_size=2,
        gpu_memory_fraction=0.7,
        attention_backend="fa3",
        max_model_len=4096,
        server_args=["--disable-radix-cache"],
    )
    check_placement(cfg, gpus=2)
    cmd = sglang_command(cfg, tmp_path / "python", tmp_path / "v000000", 30000, "policy")
    assert cmd[1:3] == ["-c", LAUNCHER]  # python -m sglang.launch_server, keyed
    flags = " ".join(cmd[3:])
    assert flags.startswith("--model-path")
    for flag in (
        "--tp-size 2",
        "--mem-fraction-static 0.7",
        "--attention-backend fa3",
        "--context-length 4096",
        "--dtype bfloat16",
        "--served-model-name policy",
        "--host 127.0.0.1 --port 30000",
    ):
        assert flag in flags
    assert cmd[-1] == "--disable-radix-cache"


def test_the_sglang_key_is_in_its_environment_never_on_a_command_line(tmp_path):
    """/proc/<pid>/cmdline is readable by every user of the machine: the key goes in the
    environment (readable by its user only), and the launcher hands it to SGLang's
    argument parser inside the process. A stand-in `sglang.launch_server` reports what
    it got."""
    key = "the-sglang-key"
    package = tmp_path / "sglang"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(
        "import json, os, sys\n"
        "if __name__ == '__main__':\n"
        "    cmdline = open('/proc/self/cmdline', 'rb').read().decode()\n"
        "    print(json.dumps({'argv': sys.argv[1:], 'cmdline': cmdline,\n"
        f"                      'inherited': os.environ.get({KEY_VARIABLE!r})}}))\n"
    )
    cfg = EngineConfig(type="sglang", server_args=["--api-key", "not-this-one"])
    cmd = sglang_command(cfg, Path(sys.executable), tmp_path / "v000000", 30000, "policy")
    env = sglang_env(key)
    assert env[KEY_VARIABLE] == key and not any(key in arg for arg in cmd)
    env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    seen = json.loads(done.stdout)
    assert seen["argv"][:2] == ["--model-path", str(tmp_path / "v000000")]
    assert seen["argv"][-2:] == ["--api-key", key]  # last: it wins over server_args'
    assert key not in seen["cmdline"]
    assert seen["inherited"] is None  # what SGLang starts does not get it


async def test_the_servers_control_endpoints_need_its_key(server, engine):
    """Loading weights is a control call: without the key it is refused, with it (as
    looprl sends it) it works."""
    url, state, _ = server
    async with httpx.AsyncClient(base_url=url) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            for path in ("/update_weights_from_disk", "/pause_generation", "/generate"):
                response = await http.post(path, json={}, headers=headers)
                assert response.status_code == 401, (path, headers)
        assert (await http.get("/health")).status_code == 200
    await engine.pause()
    await engine.resume()  # looprl's own control calls carry the key
    assert engine.version == 0
