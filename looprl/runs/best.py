"""The best policy of a run: saved to best/ beside model/ whenever a held-out
evaluation beats every earlier one (eval.save_best), with the step and accuracy it
had. Owns which evaluation is the best, the folder's atomic replacement and what a
resumed run takes as its best so far; the trainer saves the policy itself (a full model
folder, or a LoRA adapter).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from pathlib import Path

from looprl.config import EvalConfig
from looprl.runs.atomic import atomic_write_text
from looprl.runs.paths import RunPaths

log = logging.getLogger(__name__)


class BestPolicy:
    """The policy at the best held-out evaluation so far, saved to `paths.best` where the
    run evaluates every eval.every_steps (eval.save_best): rewritten when an evaluation
    beats every earlier one, step 0's (the untrained policy) included; a tie keeps the
    earlier. The untrained policy is model.path itself and is not copied: when no trained
    step beats it, best/ is not written.

    A resumed run takes its best so far from the restored eval records, or from the
    folder's own record (`RECORD`: its step and accuracy) when that is better: an
    evaluation after the checkpoint it resumed from wrote it. A new run removes an
    earlier run's best/, which no record of its own describes."""

    RECORD = "looprl-best.json"

    def __init__(self, cfg: EvalConfig, paths: RunPaths, trainer, tokenizer, records, resumed):
        self.path, self.trainer, self.tokenizer = paths.best, trainer, tokenizer
        self.step: int | None = None
        self.accuracy = -math.inf
        self.saved: Path | None = None
        for record in records:
            if record["kind"] == "eval":
                self._beats(record["step"], record.get("accuracy", 0.0))
        # No eval record: no held-out rows, nothing to compare (evaluate warns).
        self.enabled = cfg.save_best and cfg.every_steps > 0 and self.step is not None
        record = self.path / self.RECORD
        if not self.enabled or not self.path.exists():
            return
        if not resumed or not record.is_file():
            shutil.rmtree(self.path, ignore_errors=True)
            log.info("Removed %s: an earlier run's best policy (or one half written)", self.path)
            return
        saved = json.loads(record.read_text())
        if saved["step"] == self.step or self._beats(saved["step"], saved["accuracy"]):
            self.saved = self.path

    def _beats(self, step: int, accuracy: float) -> bool:
        accuracy = 0.0 if accuracy is None or math.isnan(accuracy) else accuracy
        if accuracy <= self.accuracy:
            return False
        self.step, self.accuracy = step, accuracy
        return True

    async def offer(self, step: int, accuracy: float) -> None:
        """The evaluation of the policy at `step` gave `accuracy`: save it if it is the best."""
        if not self._beats(step, accuracy) or not self.enabled:
            return
        start = time.perf_counter()
        # Written aside, then moved in: a run killed meanwhile keeps the previous best.
        # (`best-merged` too, with model.lora.save_merged.)
        aside = self.path.parent / f".tmp-{self.path.name}"
        shutil.rmtree(aside, ignore_errors=True)
        aside.mkdir()
        await self.trainer.save_model(self.tokenizer, aside / self.path.name)
        record = {"step": step, "accuracy": accuracy}
        atomic_write_text(aside / self.path.name / self.RECORD, json.dumps(record))
        for written in sorted(aside.iterdir()):
            shutil.rmtree(self.path.parent / written.name, ignore_errors=True)
            written.rename(self.path.parent / written.name)
        aside.rmdir()
        self.saved = self.path
        log.info(
            "Best held-out accuracy so far, %.1f%% at step %d: saved the policy to %s (%.1f s)",
            100 * accuracy,
            step,
            self.path,
            time.perf_counter() - start,
        )

    def summary(self) -> dict:
        """TrainSummary's best_* fields; none where the run did not keep its best."""
        if not self.enabled:
            return {}
        return {"best_accuracy": self.accuracy, "best_step": self.step, "best_dir": self.saved}
