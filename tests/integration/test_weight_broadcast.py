"""Weight sync by broadcast over real gloo processes on this CPU.

A sender that is also rank 0 of its own default process group (as a trainer rank is)
sends two versions of a tiny Llama, tied, with one layer in bfloat16, in small buckets
to two receivers, one tied and one untied; each loads them into its own model. The
process functions live here, at module level, so the processes import them by name.

The processes come from a forkserver that imported this module once: fresh processes
(not forks of pytest, whose state they do not share), without importing torch and
transformers three times over (spawned, the test took 25-45 s on 2 busy cores).
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from looprl.engines.servers.process import free_port
from looprl.models import load_tokenizer
from looprl.scheduling.weight_broadcast import (
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    plan_buckets,
    weight_sync_group,
)
from tests.conftest import tiny_llama_config
from tests.support.weights import apply_to_model

HOST = "127.0.0.1"
TIMEOUT_S = 20.0
VERSIONS = (3, 4)
BUCKET_BYTES = 64 * 1024  # a decoder layer's tensors are 8-32 KiB: many buckets


def _model(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """The test's model: layer 1 in bfloat16, the rest float32."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.model.layers[1].to(torch.bfloat16)
    return model


def send(config: LlamaConfig, port: int, out: Path) -> None:
    """Rank 0: a trainer rank in its own 1-rank default group, sending VERSIONS."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = weight_sync_group(HOST, port, 0, 3, "gloo", TIMEOUT_S)
    sender = WeightSender(group, bucket_bytes=BUCKET_BYTES)
    model = _model(config, seed=0)
    for version in VERSIONS:
        with torch.no_grad():
            for tensor in model.state_dict().values():  # every value new, norms included
                tensor.copy_(torch.randn_like(tensor))
        sender.send(model.state_dict(), version)
        torch.save(model.state_dict(), out / f"sent-{version}.pt")
    total = torch.ones(1)
    dist.all_reduce(total)  # the default group still works, untouched
    assert dist.get_world_size() == 1 and total.item() == 1
    dist.destroy_process_group()


def receive(config: LlamaConfig, port: int, rank: int, out: Path) -> None:
    """Rank 1 or 2: an engine replica loading into its own model copy."""
    group = weight_sync_group(HOST, port, rank, 3, "gloo", TIMEOUT_S)
    receiver = WeightReceiver(group)
    model = _model(config, seed=rank)
    load = apply_to_model(model)
    for _ in VERSIONS:
        version = receiver.receive(load)
        torch.save(model.state_dict(), out / f"received-{rank}-{version}.pt")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_two_receivers_get_every_tensor_bit_exact_with_its_version(tmp_path, tokenizer):
    tied = tiny_llama_config(tokenizer, tie_word_embeddings=True)
    untied = tiny_llama_config(tokenizer, tie_word_embeddings=False)
    port = free_port()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    processes = [
        context.Process(target=send, args=(tied, port, tmp_path)),
        context.Process(target=receive, args=(tied, port, 1, tmp_path)),
        context.Process(target=receive, args=(untied, port, 2, tmp_path)),
    ]
    try:
        for p in processes:
            p.start()
        for p in processes:
            p.join(60)
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in processes] == [0, 0, 0], "a process failed: see its stderr"

    sent = torch.load(tmp_path / f"sent-{VERSIONS[0]}.pt")
    specs = [(n, tuple(t.shape), t.dtype) for n, t in sent.items() if n != "lm_head.weight"]
    buckets = plan_buckets(specs, BUCKET_BYTES)  # what went over the wire (the head is tied)
    assert len(buckets) == 7 and {b.dtype for b in buckets} == {torch.float32, torch.bfloat16}
    for version in VERSIONS:
        sent = torch.load(tmp_path / f"sent-{version}.pt")
        for rank in (1, 2):
            received = torch.load(tmp_path / f"received-{rank}-{version}.pt")
            assert received.keys() == sent.keys()
            for name, tensor in sent.items():
                assert received[name].dtype == tensor.dtype, name
                assert torch.equal(received[name], tensor), f"rank {rank}: {name} differs"
    # the untied receiver got the tied head under its own name
    received = torch.load(tmp_path / f"received-2-{VERSIONS[-1]}.pt")
    assert torch.equal(received["lm_head.weight"], received["model.embed_tokens.weight"])


def test_a_receiver_whose_sender_never_comes_fails_within_the_timeout():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match=f"{HOST}:{port}.*did not open it"):
        weight_sync_group(HOST, port, 1, 2, "gloo", timeout_s=1.5)
    assert time.monotonic() - started < 2.5


def test_a_sender_whose_receivers_never_come_names_them_within_the_timeout():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match=rf"{HOST}:{port}.*rank\(s\) \[1, 2\] did not join"):
        weight_sync_group(HOST, port, 0, 3, "gloo", timeout_s=1.5)
    assert time.monotonic() - started < 2.5


def test_loading_a_tensor_the_model_lacks_or_of_another_shape_names_it(tokenizer):
    model = LlamaForCausalLM(tiny_llama_config(tokenizer))
    load = apply_to_model(model)
    with pytest.raises(ValueError, match="'model.extra.weight', which LlamaForCausalLM has no"):
        load({"model.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"'model.norm.weight' arrived with shape \(3,\)"):
        load({"model.norm.weight": torch.zeros(3)})
