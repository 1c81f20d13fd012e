"""The static decode step that CUDA graphs replay (looprl/engines/local/graphs.py), run
eagerly on this CPU: every slot below the rounded row count is a row, free slots fed
token 0 at position 0, attention over a rounded width. Its logits for the rows in use
are the plain decode's, step after step, with rows leaving (free slots in the middle),
joining, and lengths crossing a width step; and what it refuses. The capture itself
runs in tests/gpu (make test-gpu)."""

from __future__ import annotations

import pytest
import torch

from looprl.engines.local.fused import WIDTH_STEP
from looprl.engines.local.graphs import DecodeGraphs, rows_bucket
from looprl.engines.local.runners import FusedRunner
from tests.gpu.conftest import VOCAB, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def test_rows_bucket_is_the_next_power_of_two():
    assert [rows_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 200, 256, 257)] == [
        1, 2, 4, 4, 8, 8, 16, 256, 256, 512,
    ]  # fmt: skip


def test_static_decode_gives_the_plain_decodes_logits_as_rows_come_and_go(model):
    budget = 4096
    plain = FusedRunner(model, budget, kernels="portable")
    static = FusedRunner(model, budget, kernels="portable", graphs="eager")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 30, 12)]
    reserved = [WIDTH_STEP + 40] * 3
    for runner in (plain, static):
        runner.prefill(prompts, reserved)
    tokens = torch.randint(3, VOCAB, (3,), generator=gen)
    steps = 0
    for step in range(WIDTH_STEP - 20):  # the 30-token row crosses a width step
        if step == 5:  # the first row leaves: slot 0 is free, rows are slots 1 and 2
            for runner in (plain, static):
                runner.keep([1, 2])
            tokens = tokens[[1, 2]]
        if step == 9:  # a new row takes the free slot 0, appended after the others
            late = [torch.randint(3, VOCAB, (7,), generator=gen).tolist()]
            for runner in (plain, static):
                runner.prefill(late, [WIDTH_STEP])
            tokens = torch.cat([tokens, torch.randint(3, VOCAB, (1,), generator=gen)])
        want, got = plain.decode(tokens), static.decode(tokens)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # float32, other shapes
        assert got.shape == (len(tokens), VOCAB)
        tokens = want.argmax(dim=-1)
        steps += 1
    assert static._slots == [1, 2, 0] and max(len(t) for t in static._tokens) > WIDTH_STEP
    assert steps == WIDTH_STEP - 20


def test_graphs_are_refused_where_they_cannot_run(model):
    with pytest.raises(ValueError, match="runs the portable kernels, not 'cpu'"):
        FusedRunner(model, 1024, kernels="cpu", graphs="eager")
    with pytest.raises(ValueError, match="graphs='sometimes' must be one of off, cuda, eager"):
        FusedRunner(model, 1024, kernels="portable", graphs="sometimes")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA device; .* on cpu"):
            FusedRunner(model, 1024, kernels="portable", graphs="cuda")


def test_weights_loaded_keeps_graphs_while_every_weight_stays_where_it_was(model):
    runner = FusedRunner(model, 1024, kernels="portable", graphs="eager")
    graphs: DecodeGraphs = runner.graphs
    graphs._graphs[(1, WIDTH_STEP)] = "a captured graph"
    runner.reload(model)  # weights written in place: same addresses
    assert graphs._graphs == {(1, WIDTH_STEP): "a captured graph"}
    runner._decoder.lm_head = runner._decoder.lm_head.clone()  # a weight moved
    graphs.weights_loaded()
    assert graphs._graphs == {}


def test_a_failed_capture_is_logged_and_the_same_step_runs_without_graphs(
    model, monkeypatch, caplog
):
    """Capturing needs CUDA, so here the capture is made to fail as torch's allocator
    did on an H200 (an internal assert): the step still returns the plain decode's
    logits, the failure is logged once, and no capture is tried again."""
    plain = FusedRunner(model, 1024, kernels="portable")
    runner = FusedRunner(model, 1024, kernels="portable", graphs="eager")
    graphs = runner.graphs
    graphs._capture = True  # as on a GPU
    tries = []

    def fail(top, width):
        tries.append((top, width))
        raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED\nmore")

    monkeypatch.setattr(graphs, "_record", fail)
    prompts = [[5, 6, 7, 8], [9, 10]]
    for r in (plain, runner):
        r.prefill(prompts, [32, 32])
    tokens = torch.tensor([11, 12])
    with caplog.at_level("WARNING", logger="looprl.engines.local.graphs"):
        for _ in range(3):
            want, got = plain.decode(tokens), runner.decode(tokens)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            tokens = want.argmax(dim=-1)
    assert tries == [(2, 64)]  # once: 2 rows, the cache's 64 columns (under a width step)
    assert graphs.failed == "RuntimeError: it->second->use_count > 0 INTERNAL ASSERT FAILED"
    (record,) = caplog.records
    assert "2 rows x 64 columns) failed" in record.message
    assert "engine.cuda_graphs=off" in record.message
