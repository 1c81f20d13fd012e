"""Wall time to 90% greedy held-out accuracy: `looprl train` vs TRL `GRPOTrainer`, both
at each framework's settings.

Claim measured: on single-digit `+`/`*` with SmolLM2-135M-Instruct, looprl reaches 90%
greedy held-out accuracy sooner than TRL's GRPOTrainer on the same CPU, at the same
hyperparameters. A setting is (prompts per step, samples per prompt, lr, schedule):

- `looprl`: 8 prompts x 8 samples, lr 2e-5 constant (looprl's default job);
- `trl`: 4 prompts x 8 samples, lr 1e-5 constant (the TRL run of BENCHMARKS.md).

Each chosen framework (`--sides`) runs at each chosen setting (`--settings`): 4 sides by
default, one after another, each in its own process. Common to all: 48 new tokens,
temperature 1, top_p 1, no KL (beta 0), one optimizer step per batch, no warm-up, no
weight decay, gradient clipping at 1, the same 60-step horizon for the lr schedule. Each
side is scored on the same 50 held-out problems (`make_splits(TaskConfig())`), greedy, 48
new tokens, answer = the last number of the reply, at step 0 and every 2 steps; it stops
at its first evaluation >= `--target` or at `--cap-min` minutes.

- looprl: `looprl train` with the setting as config overrides, run as a subprocess; its
  metrics.jsonl is polled and the run is stopped at the target.
- TRL: GRPOTrainer in `.venv-trl` (created when missing), `use_cpu`, a TrainerCallback
  running the same greedy evaluation (HF `generate`, batched). One optimizer step sees
  exactly prompts x samples completions: `generation_batch_size` = prompts x samples,
  split into micro-batches of at most 32 completions by gradient accumulation.

Made equal to looprl's defaults on the TRL side: `loss_type="dapo"` (TRL's default: the
token mean over the whole step's batch, looprl's `token_mean`), `scale_rewards="group"`
(looprl's grpo: (r - mean) / unbiased std of the group), clip epsilon 0.2 (ratio 1 here:
one step per batch), AdamW betas (0.9, 0.999), eps 1e-8, weight decay 0, max_grad_norm
1, no warm-up (all TRL's defaults too); gradient checkpointing off (TRL's default is on,
looprl's off: ~20% slower steps). Precision, the same on both sides: what looprl's
`train.compute_dtype=auto` decides on this machine, passed to looprl explicitly
(engine.dtype stays auto: bf16 on the same CPUs); where that is bf16 (AVX-512 BF16, AMX),
TRL runs `bf16=True`, bf16 autocast over float32 weights for its training and its
generation, and looprl its bf16 engine and bf16 autocast training over float32 weights.
Left different (printed, and in the JSON's details): looprl weights each token by
pi_trainer / pi_engine (`mismatch_correction=mis`) as its engine is not the trainer, TRL
samples with the trained model itself; TRL's advantage eps is 1e-4 (looprl 1e-6); and
the order of the training problems and the sampling seed (TRL shuffles with seed 42 +
`--seed`, looprl its own order with `run.seed` = `--seed`, 0 by default).

Times count from the launch of each side's process (imports and model load included;
looprl's also its recover checkpoint at step 2, a default); "train time" is the sum of
step times (generation + update) up to that evaluation, without evaluations. Where the
target is not reached, the time of the last evaluation is a lower bound of the time to
target ("> N s (cap)" in the table, the JSON row's note says so).

Duration: each side at most `--cap-min` plus one step and an evaluation, plus ~25 s of
start-up; with the default 15 min, under ~70 min for the 4 sides ([AVX-512 BF16], 2
cores: a TRL step takes ~25-40 s at 4 x 8 and ~45-75 s at 8 x 8, an evaluation ~15 s).

    .venv/bin/python bench/trl_end_to_end.py [--json PATH]              # 4 sides
    .venv/bin/python bench/trl_end_to_end.py --settings trl --sides trl  # one side
    .venv/bin/python bench/trl_end_to_end.py --settings looprl --seed 1  # another seed
    OMP_NUM_THREADS=1 .venv/bin/python bench/trl_end_to_end.py --cap-min 1 --target 0.99 \\
        --settings trl --sides trl                                       # a smoke run
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")  # looprl.tasks.arithmetic's, for .venv-trl
MAX_NEW_TOKENS, EVAL_EVERY_STEPS, TOTAL_STEPS = 48, 2, 60  # TOTAL_STEPS: the lr horizon
TRL_MICRO_BATCH = 32  # completions per TRL forward/backward
TRL_SEED = 42  # GRPOConfig's default; --seed is added to it


@dataclass(frozen=True)
class Setting:
    prompts: int  # per optimizer step
    samples: int  # per prompt
    lr: float
    schedule: str  # constant | linear | cosine, over TOTAL_STEPS

    def describe(self) -> str:
        lr = f"{self.lr:g}".replace("e-0", "e-")
        return f"{self.prompts} prompts x {self.samples} samples, lr {lr} {self.schedule}"


SETTINGS = {
    "looprl": Setting(prompts=8, samples=8, lr=2e-5, schedule="constant"),
    "trl": Setting(prompts=4, samples=8, lr=1e-5, schedule="constant"),
}
TRL_DIFFERENCES = [
    "looprl weights each token by pi_trainer / pi_engine (train.mismatch_correction=mis, "
    "cap 5): its engine is not the trainer; TRL samples with the trained model (ratio 1)",
    "generation: looprl's engine (bf16 weights where bf16 is chosen); TRL's HF generate "
    "under the same autocast as its training, over float32 weights",
    "advantage eps: TRL 1e-4, looprl 1e-6 (std of 0/1 rewards in a mixed group >= 0.35)",
    "training problem order and sampling seed: TRL seed 42 + --seed, looprl run.seed = --seed",
]


def correct(text: str, answer: int) -> bool:
    """looprl.tasks.arithmetic.arithmetic_reward == 1 (copied: looprl is not in .venv-trl)."""
    found = _NUMBER.findall(text)
    try:
        return bool(found) and float(found[-1].replace(",", "")) == float(answer)
    except ValueError:
        return False


def run_looprl(
    setting: Setting, compute_dtype: str, out: Path, target: float, cap_s: float, seed: int
) -> list[dict]:
    """Evaluations of a `looprl train` run, as {step, accuracy, time_s, train_s}."""
    overrides = [
        f"rollout.batch_size={setting.prompts}",
        f"rollout.group_size={setting.samples}",
        f"train.lr={setting.lr}",
        f"train.lr_schedule={setting.schedule}",
        "train.warmup_steps=0",
        "train.kl_coef=0",
        f"train.compute_dtype={compute_dtype}",
        f"train.total_steps={TOTAL_STEPS}",
        f"sampling.max_new_tokens={MAX_NEW_TOKENS}",
        "sampling.temperature=1",
        f"eval.every_steps={EVAL_EVERY_STEPS}",
        f"eval.max_new_tokens={MAX_NEW_TOKENS}",
        "recover.mode=off",
        f"run.seed={seed}",
        f"run.fileroot={out}",
    ]
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
    proc.terminate()  # looprl then stops after the step, with a checkpoint
    time.sleep(2)
    if proc.poll() is None:
        proc.terminate()  # a second SIGTERM: at once, without one
    proc.wait()
    return evals


def trl_side(
    out: Path,
    task_file: Path,
    setting: Setting,
    bf16: bool,
    target: float,
    cap_s: float,
    start: float,
    seed: int,
):
    """Runs in .venv-trl: GRPOTrainer with an evaluating callback; writes trl_evals.json."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task = json.loads(task_file.read_text())
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
                ids = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
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
            step_s = time.time() - self.step_start
            self.train_s += step_s
            print(json.dumps({"step": state.global_step, "step_s": step_s}), flush=True)
            if state.global_step % EVAL_EVERY_STEPS == 0:
                control.should_training_stop = self.evaluate(
                    state.global_step, model, processing_class
                )
            elif time.time() - start > cap_s:
                control.should_training_stop = True

    completions = setting.prompts * setting.samples
    accumulation = -(-completions // TRL_MICRO_BATCH)
    if completions % accumulation:
        raise ValueError(
            f"{setting.prompts} prompts x {setting.samples} samples = {completions} "
            f"completions do not split into {accumulation} equal micro-batches of at most "
            f"{TRL_MICRO_BATCH}; choose a multiple of {accumulation}"
        )
    args = GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=True,
        bf16=bf16,
        model_init_kwargs={"dtype": torch.float32},  # master weights, as looprl's
        gradient_checkpointing=False,  # TRL's default is on; looprl's is off
        num_generations=setting.samples,
        generation_batch_size=completions,  # one generation batch per optimizer step
        per_device_train_batch_size=completions // accumulation,
        gradient_accumulation_steps=accumulation,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        epsilon=0.2,
        num_iterations=1,
        learning_rate=setting.lr,
        lr_scheduler_type=setting.schedule,
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        max_steps=TOTAL_STEPS,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=TRL_SEED + seed,
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


def run_trl(
    name: str,
    bf16: bool,
    task_file: Path,
    out: Path,
    target: float,
    cap_min: float,
    python: Path,
    seed: int,
) -> list[dict]:
    """Evaluations of a TRL run at setting `name`, in its own .venv-trl process."""
    cmd = [str(python), __file__, "--out", str(out), "--task", str(task_file)]
    cmd += ["--seed", str(seed)]
    cmd += ["--trl-side", str(time.time()), "--settings", name]
    cmd += ["--target", str(target), "--cap-min", str(cap_min)] + (["--trl-bf16"] if bf16 else [])
    with (out / "trl.log").open("w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = (out / "trl.log").read_text().splitlines()[-5:]
        print(f"TRL side failed (exit status {done.returncode}); {out / 'trl.log'} ends:")
        print("\n".join(tail), flush=True)
    path = out / "trl_evals.json"
    return json.loads(path.read_text()) if path.exists() else []


def first_at(evals: list[dict], target: float) -> dict | None:
    return next((e for e in evals if e["accuracy"] >= target), None)


def time_to(evals: list[dict], target: float) -> tuple[float, bool] | None:
    """(seconds to the target, reached); not reached: the last evaluation's time, a lower
    bound. None without any evaluation."""
    hit = first_at(evals, target)
    if hit is not None:
        return hit["time_s"], True
    return (evals[-1]["time_s"], False) if evals else None


def table_row(setting: str, framework: str, evals: list[dict], target: float) -> str:
    if not evals:
        return f"| {setting} | {framework} | no evaluation (see its log) | | | |"
    hit, start = first_at(evals, target), f"{evals[0]['accuracy']:.0%}"
    if hit is None:
        last, best = evals[-1], max(e["accuracy"] for e in evals)
        return (
            f"| {setting} | {framework} | not reached in {last['step']} | {start} -> best "
            f"{best:.0%} | > {last['time_s']:.0f} s (cap) | > {last['train_s']:.0f} s |"
        )
    return (
        f"| {setting} | {framework} | {hit['step']} | {start} -> {hit['accuracy']:.0%} | "
        f"{hit['time_s']:.0f} s | {hit['train_s']:.0f} s |"
    )


def compare(looprl: list[dict], trl: list[dict], target: float) -> tuple[str, str]:
    """The ratio looprl / TRL of the times to target as text, with a note on bounds."""
    ours, theirs = time_to(looprl, target), time_to(trl, target)
    if ours is None or theirs is None:
        return "n/a", "a side has no evaluation"
    ratio = ours[0] / theirs[0]
    if ours[1] and theirs[1]:
        return f"{ratio:.2f}x", ""
    if ours[1]:
        return f"< {ratio:.2f}x", f"TRL not reached by step {trl[-1]['step']}; lower bound"
    if theirs[1]:
        return f"> {ratio:.2f}x", f"looprl not reached by step {looprl[-1]['step']}; lower bound"
    return "n/a", "neither reached; both times lower bounds"


def report(results: dict[str, dict[str, list[dict]]], target: float, trl_name: str) -> list:
    """Print the table and each setting's ratio; the rows (bench/common.py) of the
    settings where both frameworks ran."""
    from common import Row

    reach = f"{target:.0%}"
    print(
        f"\n| setting | framework | steps | held-out accuracy at step 0 -> first >= {reach} ",
        end="",
    )
    print(f"(or best) | wall time to {reach} | train time |\n|---|---|---:|---|---:|---:|")
    for name, sides in results.items():
        for framework, evals in sides.items():
            print(table_row(name, framework, evals, target))
    rows = []
    for name, sides in results.items():
        if len(sides) < 2:
            continue
        ratio, note = compare(sides["looprl"], sides["trl"], target)
        print(f"{name} settings: time to {target:.0%}, looprl / TRL: {ratio} {note}".rstrip())
        ours, theirs = time_to(sides["looprl"], target), time_to(sides["trl"], target)
        if ours is not None and theirs is not None:
            figure = (
                f"wall time to {target:.0%} held-out, {name} settings ({SETTINGS[name].describe()})"
            )
            row = Row(
                figure=figure,
                looprl=ours[0],
                baseline=theirs[0],
                baseline_name=trl_name,
                unit="s",
                better="lower",
                note=note,
            )
            rows.append(row)
    return rows


def training_precision(model_dir: Path):
    """What `train.compute_dtype=auto` decides on this machine (looprl/startup.py's
    decision, from the model's layer shape): both frameworks then train in it."""
    from transformers import AutoConfig

    from looprl import precision

    shape = precision.layer_shape(AutoConfig.from_pretrained(model_dir))
    return precision.decide_train("auto", "float32", precision.probe("cpu", *shape))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--cap-min", type=float, default=15.0, help="per side")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--sides", nargs="+", choices=["looprl", "trl"], default=["looprl", "trl"])
    parser.add_argument("--out", type=Path, default=None, help="work folder (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write the rows here (bench/common.py)")
    parser.add_argument(
        "--seed", type=int, default=0, help="looprl's run.seed; TRL's seed is 42 + this"
    )
    parser.add_argument("--trl-side", type=float, help=argparse.SUPPRESS)  # start time
    parser.add_argument("--trl-bf16", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--task", type=Path, help=argparse.SUPPRESS)  # task.json
    args = parser.parse_args()
    cap_s = 60 * args.cap_min
    if args.trl_side:
        setting = SETTINGS[args.settings[0]]
        trl_side(
            args.out,
            args.task,
            setting,
            args.trl_bf16,
            args.target,
            cap_s,
            args.trl_side,
            args.seed,
        )
        return

    from common import write_result  # not in .venv-trl: it imports looprl
    from trl_train_throughput import TRL_PY, ensure_trl_venv, trl_versions

    from looprl.config import TaskConfig
    from looprl.models import default_model_dir
    from looprl.tasks.arithmetic import make_splits

    versions = {}
    if "trl" in args.sides:
        ensure_trl_venv()
        versions = trl_versions()
    out = args.out or Path(tempfile.mkdtemp(prefix="trl_e2e_"))
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = make_splits(TaskConfig())
    model_dir = default_model_dir()
    task = {"model": str(model_dir), "train": train, "eval": held_out}
    (out / "task.json").write_text(json.dumps(task))
    decided = training_precision(model_dir)
    bf16 = decided.dtype == "bfloat16"
    print(f"work folder {out}; {len(held_out)} held-out problems; TRL side: {versions}")
    print(f"seeds: looprl run.seed={args.seed}, TRL seed={TRL_SEED + args.seed}")
    print(f"precision, both sides: {decided.describe()}; TRL bf16={bf16}")
    print("left different on the TRL side:\n- " + "\n- ".join(TRL_DIFFERENCES), flush=True)
    results: dict[str, dict[str, list[dict]]] = {}
    for name in args.settings:
        setting, results[name] = SETTINGS[name], {}
        for framework in args.sides:
            side_out = out / name / framework
            side_out.mkdir(parents=True, exist_ok=True)
            print(f"{framework} at {name} settings ({setting.describe()}) ...", flush=True)
            if framework == "looprl":
                evals = run_looprl(setting, decided.dtype, side_out, args.target, cap_s, args.seed)
            else:
                task_file = out / "task.json"
                evals = run_trl(
                    name, bf16, task_file, side_out, args.target, args.cap_min, TRL_PY, args.seed
                )
            results[name][framework] = evals
            print(f"{framework}: {json.dumps(evals)}", flush=True)

    trl_name = f"TRL {versions['trl']} GRPOTrainer" if versions else "TRL"
    rows = report(results, args.target, trl_name)
    if args.json:
        details = {
            "target": args.target,
            "cap_min": args.cap_min,
            "settings": {name: asdict(SETTINGS[name]) for name in args.settings},
            "common": {
                "max_new_tokens": MAX_NEW_TOKENS,
                "temperature": 1.0,
                "kl": 0.0,
                "eval_every_steps": EVAL_EVERY_STEPS,
                "lr_horizon_steps": TOTAL_STEPS,
                "held_out_problems": len(held_out),
            },
            "precision": decided.describe(),
            "trl_bf16": bf16,
            "trl_micro_batch": TRL_MICRO_BATCH,
            "trl_side_versions": versions,
            "seed": {"looprl": args.seed, "trl": TRL_SEED + args.seed},
            "differences_left": TRL_DIFFERENCES,
            "evals": results,
        }
        write_result(args.json, "time_to_90", rows, details)


if __name__ == "__main__":
    main()
