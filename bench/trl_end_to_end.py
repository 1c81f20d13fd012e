"""Wall time to 90% greedy held-out accuracy: `looprl train` vs TRL `GRPOTrainer`.

Claim measured: on single-digit `+`/`*` with SmolLM2-135M-Instruct, looprl's default job
reaches 90% greedy held-out accuracy sooner than TRL's GRPOTrainer on the same CPU. Both
are scored on the same 50 held-out problems (`make_splits(TaskConfig())`), greedy, 48
new tokens, answer = last number in the reply, every 2 steps and at step 0; a side stops
at its first evaluation >= the target or after `--cap-min` minutes.

- looprl: `looprl train` with the default config (8 prompts x 8 samples per step, lr 2e-5,
  bf16 engine + bf16 autocast) and train.total_steps=60 eval.every_steps=2, run as a
  subprocess; its metrics.jsonl is polled and the run is stopped at the target.
- TRL: GRPOTrainer in `.venv-trl`, 4 prompts x 8 completions per step, 48 new tokens,
  temperature 1, lr 1e-5 constant, beta 0, use_cpu, otherwise TRL's defaults; a
  TrainerCallback runs the same greedy evaluation (HF `generate`, batched).

Times count from the launch of each side's process (imports and model load included);
"train time" is the sum of step times up to that evaluation, without evaluations.

    .venv/bin/python bench/trl_end_to_end.py
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")  # looprl.tasks.arithmetic's, for .venv-trl


def correct(text: str, answer: int) -> bool:
    """looprl.tasks.arithmetic.arithmetic_reward == 1 (copied: looprl is not in .venv-trl)."""
    found = _NUMBER.findall(text)
    try:
        return bool(found) and float(found[-1].replace(",", "")) == float(answer)
    except ValueError:
        return False


def run_looprl(out: Path, target: float, cap_s: float) -> list[dict]:
    """Evaluations of a `looprl train` run, as {step, accuracy, time_s, train_s}."""
    overrides = ["train.total_steps=60", "eval.every_steps=2", f"run.fileroot={out}"]
    start = time.time()
    proc = subprocess.Popen(
        [str(ROOT / ".venv/bin/looprl"), "train", *overrides],
        stdout=(out / "looprl.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    metrics = out / "default" / "trial0" / "metrics.jsonl"
    evals: list[dict] = []
    while proc.poll() is None and time.time() - start < cap_s:
        time.sleep(2)
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        train_s, evals = 0.0, []
        for r in map(json.loads, lines):
            if r["kind"] == "train":
                train_s += r["step_time_s"]
            elif r["kind"] == "eval":
                row = {"step": r["step"], "accuracy": r["accuracy"], "time_s": r["time"] - start}
                evals.append({**row, "train_s": train_s})
        if evals and evals[-1]["accuracy"] >= target:
            break
    proc.terminate()
    proc.wait()
    return evals


def trl_side(out: Path, target: float, cap_s: float, start: float) -> None:
    """Runs in .venv-trl: GRPOTrainer with an evaluating callback; writes trl_evals.json."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task = json.loads((out / "task.json").read_text())
    chat = [[{"role": "user", "content": r["question"]}] for r in task["eval"]]
    evals: list[dict] = []

    def reward(completions, answer, **_) -> list[float]:
        return [
            float(correct(c[-1]["content"], a)) for c, a in zip(completions, answer, strict=True)
        ]

    class Evaluate(TrainerCallback):
        train_s, step_start = 0.0, 0.0

        def evaluate(self, step: int, model, tok) -> bool:
            was_training = model.training
            model.eval()
            tok.padding_side = "left"
            enc = tok.apply_chat_template(
                chat,
                add_generation_prompt=True,
                return_dict=True,
                padding=True,
                return_tensors="pt",
            )
            with torch.inference_mode():
                ids = model.generate(**enc, max_new_tokens=48, do_sample=False)
            texts = tok.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            acc = sum(
                correct(t, r["answer"]) for t, r in zip(texts, task["eval"], strict=True)
            ) / len(texts)
            model.train(was_training)
            row = {"step": step, "accuracy": acc, "time_s": time.time() - start}
            evals.append({**row, "train_s": self.train_s})
            print(json.dumps(evals[-1]), flush=True)
            (out / "trl_evals.json").write_text(json.dumps(evals))
            return acc >= target or time.time() - start > cap_s

        def on_train_begin(self, args, state, control, model=None, processing_class=None, **kw):
            control.should_training_stop = self.evaluate(0, model, processing_class)

        def on_step_begin(self, args, state, control, **kw):
            self.step_start = time.time()

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
            self.train_s += time.time() - self.step_start
            if state.global_step % 2 == 0:
                control.should_training_stop = self.evaluate(
                    state.global_step, model, processing_class
                )
            elif time.time() - start > cap_s:
                control.should_training_stop = True

    args = GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=True,
        bf16=False,
        beta=0.0,
        num_generations=8,
        per_device_train_batch_size=32,  # completions: 4 prompts x 8
        max_completion_length=48,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        max_steps=200,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        model_init_kwargs={"dtype": torch.float32},
    )
    rows = [
        {"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
        for r in task["train"]
    ]
    trainer = GRPOTrainer(
        model=task["model"],
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        callbacks=[Evaluate()],
    )
    trainer.train()


def first_at(evals: list[dict], target: float) -> dict | None:
    return next((e for e in evals if e["accuracy"] >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--cap-min", type=float, default=15.0)
    parser.add_argument("--sides", nargs="+", default=["looprl", "trl"])
    parser.add_argument("--out", type=Path, default=None, help="work folder (default: a temp dir)")
    parser.add_argument("--trl-side", type=float, help=argparse.SUPPRESS)  # start time
    args = parser.parse_args()
    cap_s = 60 * args.cap_min
    if args.trl_side:
        trl_side(args.out, args.target, cap_s, args.trl_side)
        return

    from looprl.config import TaskConfig
    from looprl.models import default_model_dir
    from looprl.tasks.arithmetic import make_splits

    sys.path.insert(0, str(Path(__file__).parent))
    from trl_train_throughput import TRL_PY, ensure_trl_venv, trl_versions

    ensure_trl_venv()
    out = args.out or Path(tempfile.mkdtemp(prefix="trl_e2e_"))
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = make_splits(TaskConfig())
    task = {"model": str(default_model_dir()), "train": train, "eval": held_out}
    (out / "task.json").write_text(json.dumps(task))
    print(f"work folder {out}; {len(held_out)} held-out problems; TRL side: {trl_versions()}")
    results = {}
    if "looprl" in args.sides:
        results["looprl"] = run_looprl(out, args.target, cap_s)
        print("looprl:", json.dumps(results["looprl"]), flush=True)
    if "trl" in args.sides:
        cmd = [str(TRL_PY), __file__, "--out", str(out), "--trl-side", str(time.time())]
        cmd += ["--target", str(args.target), "--cap-min", str(args.cap_min)]
        with (out / "trl.log").open("w") as log:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
        path = out / "trl_evals.json"
        results["trl"] = json.loads(path.read_text()) if path.exists() else []
        print("trl:", json.dumps(results["trl"]), flush=True)
    print(f"| side | steps | held-out accuracy at step 0 -> first >= {args.target:.0%} |", end="")
    print(" wall time | train time (no evals) |\n|---|---:|---|---:|---:|")
    for side, evals in results.items():
        hit = first_at(evals, args.target)
        start = f"{evals[0]['accuracy']:.0%}" if evals else "?"
        if hit is None:
            last = evals[-1] if evals else {"step": 0, "accuracy": 0.0, "time_s": 0.0}
            print(f"| {side} | not reached in {last['step']} steps | {start} -> best ", end="")
            print(f"{max(e['accuracy'] for e in evals):.0%} | > {last['time_s']:.0f} s | |")
        else:
            print(f"| {side} | {hit['step']} | {start} -> {hit['accuracy']:.0%} | ", end="")
            print(f"{hit['time_s']:.0f} s | {hit['train_s']:.0f} s |")
    if all(first_at(e, args.target) for e in results.values()) and len(results) == 2:
        ratio = first_at(results["trl"], args.target)["time_s"]
        ratio /= first_at(results["looprl"], args.target)["time_s"]
        print(f"wall-time ratio TRL/looprl: {ratio:.2f}x")


if __name__ == "__main__":
    main()
