"""End to end: the real loop, gateway, engine and trainer make a tiny model learn.

The toy job and its reward (the fraction of sampled tokens with an even id) are in
tests/support/toy_job.py: a random-init model starts near 0.5, and only learning
(weights moving and reaching the engine) raises it.
make test runs the precision and LoRA tests again on a CPU forced to AVX2 (`kernels`);
the float32 toy jobs would repeat the first there, where `auto` is float32.
"""

from __future__ import annotations

import pytest

from looprl import startup
from looprl.loop import train
from tests.support.toy_job import learned_steps, toy_job


@pytest.mark.slow
@pytest.mark.parametrize("max_head_offpolicyness", [0, 2])
async def test_tiny_model_learns_a_toy_reward(peaked_model_dir, tmp_path, max_head_offpolicyness):
    """Synchronous (0) and asynchronous (2: rollouts run up to two versions ahead)."""
    cfg = toy_job(
        peaked_model_dir, tmp_path, f"rollout.max_head_offpolicyness={max_head_offpolicyness}"
    )
    summary = await train(cfg, show_progress=False)

    steps = learned_steps(cfg, f"max_head_offpolicyness={max_head_offpolicyness}")
    staleness = [r["staleness_max"] for r in steps]
    # Engine vs trainer, float32 both, on the tokens of the trainer's own version.
    fresh = [r["mismatch_tokens_frac"] for r in steps]
    assert all(r["mismatch_logprob_abs_mean"] < 1e-3 for r in steps), steps[0]
    assert all(r["mismatch_ratio_outside_frac"] == 0 for r in steps)
    if max_head_offpolicyness == 0:
        assert staleness == [0] * 10
        assert fresh == [1.0] * 10
    else:  # ran ahead of the trainer, never past the bound
        assert max(staleness) <= max_head_offpolicyness and max(staleness) > 0, staleness
        assert min(fresh) < 1.0, fresh  # stale tokens are left out of the mismatch figures
    assert (cfg.run_dir / "reward.png").stat().st_size > 0
    assert (summary.model_dir / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.kernels  # run again on a forced AVX2 CPU by make test, where auto is float32
async def test_tiny_model_learns_in_the_precision_this_machine_picks(peaked_model_dir, tmp_path):
    """engine.dtype and train.compute_dtype left at auto: bfloat16 where the CPU has
    hardware bf16, float32 where it has not (make test's forced AVX2 run)."""
    cfg = toy_job(peaked_model_dir, tmp_path, "engine.dtype=auto", "train.compute_dtype=auto")
    decided = startup.start(cfg).precision
    await train(cfg, show_progress=False)
    learned_steps(cfg, decided.line())


@pytest.mark.slow
@pytest.mark.kernels  # the engine's adapter merge, on the forced AVX2 CPU too
async def test_tiny_model_learns_with_lora_adapters_only(peaked_model_dir, tmp_path):
    """model.lora: the engine serves base + adapter (a low-rank term, the base never
    reloaded), the checkpoint holds the adapter, the run ends with an adapter folder and
    the merged model beside it."""
    cfg = toy_job(
        peaked_model_dir,
        tmp_path,
        "model.lora.rank=8",
        "model.lora.save_merged=true",
        "checkpoint.keep_on_finish=true",  # its checkpoint is read below
    )
    summary = await train(cfg, show_progress=False)

    learned_steps(cfg, "LoRA rank 8")
    assert (summary.model_dir / "adapter_model.safetensors").is_file()
    assert not (summary.model_dir / "model.safetensors").exists()
    merged = summary.model_dir.with_name("model-merged")
    assert (merged / "model.safetensors").is_file()
    checkpoint = next((cfg.run_dir / "checkpoints").glob("step_*"))
    base = (peaked_model_dir / "model.safetensors").stat().st_size
    assert (checkpoint / "trainer.safetensors").stat().st_size < base / 4
