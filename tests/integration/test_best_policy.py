"""eval.save_best: the policy at the run's best held-out evaluation is saved to best/
beside model/ (full fine-tuning: the model folder; LoRA: the adapter), and the final
line says both; a finished trial run again by the same command says so and exits 0.

The toy job (tests/support/toy_job.py) on the peaked tiny model, evaluated after every
step and checkpointed after every step (kept at the end): what best/ holds is checked
against the recover checkpoint of the step the run's own eval records name as best.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from looprl.loop import TrainSummary, train
from looprl.runs.best import BestPolicy
from looprl.runs.checkpoint import load_tree
from looprl.runs.paths import RunPaths
from tests.support.tiny_run import metrics_records
from tests.support.toy_job import toy_job, toy_job_overrides

EVERY_STEP = (
    "train.total_steps=5",
    "eval.every_steps=1",
    "eval.size=4",
    "eval.max_new_tokens=3",  # accuracy: 3 greedy tokens all even, reached in a few steps
    "checkpoint.save_every_steps=1",
    "checkpoint.keep_last=10",
    "checkpoint.keep_on_finish=true",
)


def best_of(evals: list[dict]) -> tuple[int, float]:
    """(step, accuracy) of the first evaluation no later one beats."""
    best = evals[0]
    for record in evals[1:]:
        if record["accuracy"] > best["accuracy"]:
            best = record
    return best["step"], best["accuracy"]


def checkpoint_weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    return load_tree(RunPaths(run_dir).checkpoints / f"step_{step:06d}", "trainer")["model"]


def assert_saved_best(summary: TrainSummary, cfg) -> int:
    """best/ and the summary agree with the eval records; returns the best step."""
    evals = metrics_records(cfg.run_dir, "eval")
    assert [r["step"] for r in evals] == list(range(6)), evals
    step, accuracy = best_of(evals)
    print("eval accuracies:", [r["accuracy"] for r in evals], "best:", step)
    assert (summary.best_step, summary.best_accuracy) == (step, accuracy)
    best = RunPaths(cfg.run_dir).best
    if step == 0:  # no step beat the untrained policy: model.path itself, not copied
        assert not best.exists() and summary.best_dir is None
        assert "no step beat the untrained policy" in summary.line()
        return step
    assert summary.best_dir == best
    assert json.loads((best / BestPolicy.RECORD).read_text()) == {
        "step": step,
        "accuracy": accuracy,
    }
    assert f"(best {100 * accuracy:.1f}% at step {step}, saved to {best})" in summary.line()
    assert not list(best.parent.glob(".tmp-*"))
    return step


@pytest.mark.slow
async def test_a_full_run_saves_the_model_of_its_best_evaluation(peaked_model_dir, tmp_path):
    cfg = toy_job(peaked_model_dir, tmp_path, *EVERY_STEP)
    summary = await train(cfg, show_progress=False)
    step = assert_saved_best(summary, cfg)
    assert step > 0, "the toy job improves on its untrained policy"
    saved = load_file(str(summary.best_dir / "model.safetensors"))
    expected = checkpoint_weights(cfg.run_dir, step)
    assert saved.keys() <= expected.keys()
    for name, tensor in saved.items():
        assert torch.equal(tensor, expected[name]), name
    assert (summary.best_dir / "tokenizer_config.json").is_file()


@pytest.mark.slow
async def test_a_lora_run_saves_the_adapter_of_its_best_evaluation(peaked_model_dir, tmp_path):
    cfg = toy_job(peaked_model_dir, tmp_path, *EVERY_STEP, "model.lora.rank=8", "train.lr=1e-2")
    summary = await train(cfg, show_progress=False)
    step = assert_saved_best(summary, cfg)
    if step == 0:
        return
    assert not (summary.best_dir / "model.safetensors").exists()
    saved = load_file(str(summary.best_dir / "adapter_model.safetensors"))
    expected = checkpoint_weights(cfg.run_dir, step)
    # peft's file drops the adapter's name ("default") from the parameter names
    by_shape = {name.replace(".default", ""): t for name, t in expected.items()}
    assert len(saved) == len(by_shape) > 0
    for name, tensor in saved.items():
        match = [k for k in by_shape if k.endswith(name.split("base_model.model.", 1)[-1])]
        assert len(match) == 1, (name, list(by_shape)[:3])
        assert torch.equal(tensor, by_shape[match[0]]), name


def test_the_summary_line_names_the_best_and_where_it_is():
    line = TrainSummary(0.16, 0.38, 3.0, 12, "r", "r/model", 0.6, 4, "r/best").line()
    assert line.startswith(
        "held-out accuracy: 16.0% -> 38.0% (best 60.0% at step 4, saved to r/best)"
    )
    untrained = TrainSummary(0.5, 0.25, 3.0, 12, "r", "r/model", 0.5, 0, None).line()
    assert "(no step beat the untrained policy: nothing saved to best)" in untrained
    plain = TrainSummary(0.16, 0.38, 3.0, 12, "r", "r/model").line()
    assert (
        plain == "held-out accuracy: 16.0% -> 38.0% in 3.0 min (12 steps); model saved to r/model"
    )


def run_train(args: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "looprl.cli", "train", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_a_finished_trial_run_again_says_it_finished_and_exits_0(tiny_model_dir, tmp_path):
    """A job retried after its run ended (its checkpoints removed) succeeds, training
    nothing; recover.mode=off trains it again; another config is refused."""
    args = toy_job_overrides(tiny_model_dir, tmp_path, "train.total_steps=2", "eval.every_steps=1")
    first = run_train(args)
    assert first.returncode == 0, first.stderr[-3000:]
    paths = RunPaths(tmp_path / "default" / "trial0")
    assert not paths.checkpoints.exists() and paths.summary.is_file()
    final = first.stdout.strip().splitlines()[-1]
    assert final.startswith("held-out accuracy:"), first.stdout

    again = run_train(args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.strip().splitlines()[-1] == f"This trial already finished: {final}"
    assert len(metrics_records(paths.root, "train")) == 2  # nothing trained

    longer = run_train([*args, "train.total_steps=3"])
    assert longer.returncode == 2
    assert "train.total_steps: 2 -> 3" in longer.stderr + longer.stdout
    assert "recover.mode=off" in longer.stderr + longer.stdout

    fresh = run_train([*args, "recover.mode=off"])
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert fresh.stdout.strip().splitlines()[-1].startswith("held-out accuracy:")
    assert "already finished" not in fresh.stdout
    assert [r["step"] for r in metrics_records(paths.root, "train")] == [1, 2]
