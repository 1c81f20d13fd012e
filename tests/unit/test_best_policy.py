"""BestPolicy (runs/best.py): which evaluation is the best, when best/ is written, what a
resumed run takes as its best so far. The trainer here writes a one-file folder naming
the step it holds; tests/integration/test_best_policy.py saves real models."""

from __future__ import annotations

import json

from looprl.config import load_config
from looprl.runs.best import BestPolicy
from looprl.runs.paths import RunPaths


class FolderTrainer:
    """save_model writes `out/step` with the step the test says it is at."""

    def __init__(self):
        self.step, self.saves = 0, 0

    async def save_model(self, tokenizer, out):
        out.mkdir(parents=True)
        (out / "step").write_text(str(self.step))
        self.saves += 1
        return out


def evals(*accuracies: float) -> list[dict]:
    return [{"kind": "eval", "step": s, "accuracy": a} for s, a in enumerate(accuracies)]


def best_policy(tmp_path, records, resumed=None, *overrides):
    cfg = load_config(None, [f"run.fileroot={tmp_path}", "eval.every_steps=1", *overrides])
    trainer = FolderTrainer()
    return BestPolicy(cfg.eval, RunPaths(tmp_path), trainer, None, records, resumed), trainer


async def offer(best, trainer, step, accuracy):
    trainer.step = step
    await best.offer(step, accuracy)


async def test_a_better_evaluation_is_saved_and_a_tie_is_not(tmp_path):
    best, trainer = best_policy(tmp_path, evals(0.5))
    await offer(best, trainer, 1, 0.5)  # ties the untrained policy: nothing written
    assert not (tmp_path / "best").exists() and best.summary()["best_step"] == 0
    await offer(best, trainer, 2, 0.75)
    await offer(best, trainer, 3, 0.75)
    await offer(best, trainer, 4, 0.25)
    assert trainer.saves == 1 and (tmp_path / "best" / "step").read_text() == "2"
    assert json.loads((tmp_path / "best" / BestPolicy.RECORD).read_text()) == {
        "step": 2,
        "accuracy": 0.75,
    }
    assert best.summary() == {"best_accuracy": 0.75, "best_step": 2, "best_dir": tmp_path / "best"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]  # nothing left aside


async def test_a_run_that_does_not_keep_its_best_writes_nothing(tmp_path):
    for records, overrides in [(evals(0.5), ["eval.save_best=false"]), ([], [])]:
        best, trainer = best_policy(tmp_path, records, None, *overrides)
        await offer(best, trainer, 1, 0.9)
        assert trainer.saves == 0 and best.summary() == {}  # no held-out rows: no eval record


async def test_a_new_run_removes_an_earlier_runs_best(tmp_path):
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / BestPolicy.RECORD).write_text('{"step": 3, "accuracy": 1.0}')
    best, _ = best_policy(tmp_path, evals(0.5))
    assert not (tmp_path / "best").exists() and best.summary()["best_dir"] is None


async def test_a_resumed_run_takes_its_best_from_the_records_or_the_folder(tmp_path):
    records = evals(0.25, 0.5, 0.25)  # a checkpoint after step 2; best/ of step 1
    first, trainer = best_policy(tmp_path, evals(0.25))
    await offer(first, trainer, 1, 0.5)
    best, _ = best_policy(tmp_path, records, resumed=True)
    assert best.summary() == {"best_accuracy": 0.5, "best_step": 1, "best_dir": tmp_path / "best"}

    await offer(first, trainer, 3, 0.75)  # written after the checkpoint, before a kill
    best, trainer = best_policy(tmp_path, records, resumed=True)
    assert best.summary() == {"best_accuracy": 0.75, "best_step": 3, "best_dir": tmp_path / "best"}
    await offer(best, trainer, 3, 0.5)  # the replayed step does worse: step 3's is kept
    assert trainer.saves == 0 and (tmp_path / "best" / "step").read_text() == "3"
