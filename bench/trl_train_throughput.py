"""looprl `Trainer.train_step` vs TRL `GRPOTrainer`'s loss + backward + optimizer step.

Claim measured: on the same batch (32 sequences: 4 chat-templated arithmetic prompts x 8
completions of 48 tokens, the same token ids and advantages on both sides), looprl's
train_step processes more prompt + completion tokens per second than TRL's GRPO update.
TRL's side is `trainer.compute_loss(model, inputs)` + `accelerator.backward` + grad-norm
clip + optimizer step + zero_grad, on inputs in the format its `_compute_loss` reads,
after `accelerator.prepare` as in its training loop; no generation on either side. Both
use fp32 master weights, lr 2e-5, max_grad_norm 1, no KL; "bf16" is bf16 autocast
(looprl: train.compute_dtype=bfloat16, TRL: bf16=True). Each side is warmed up once, then timed
`--repeats` times; the best is reported.

TRL runs in its own venv, `.venv-trl` (created when missing), in a subprocess that runs
this file with `--trl-side`:

    .venv/bin/python bench/trl_train_throughput.py [--json PATH]   # PATH: bench/common.py's rows
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TRL_VENV = ROOT / ".venv-trl"
TRL_PY = TRL_VENV / "bin" / "python"
QUESTIONS = ["What is 7 * 8?", "What is 3 + 4?", "What is 9 * 6?", "What is 5 + 8?"]
GROUP, COMPLETION_TOKENS, LR = 8, 48, 2e-5


def ensure_trl_venv() -> None:
    """Create .venv-trl with torch 2.13.0 (the local CPU wheel) and the newest TRL."""
    from looprl.engines.servers.venvs import ensure_venv  # here: this file also runs in .venv-trl

    ensure_venv(TRL_VENV, ["torch==2.13.0", "trl"])


def trl_versions() -> dict[str, str]:
    code = "import trl, transformers, torch, accelerate as a; print(trl.__version__, "
    code += "transformers.__version__, torch.__version__, a.__version__)"
    out = subprocess.run([str(TRL_PY), "-c", code], capture_output=True, text=True, check=True)
    names = ["trl", "transformers", "torch", "accelerate"]
    return dict(zip(names, out.stdout.split(), strict=True))


def make_batch(model_dir: Path) -> dict[str, torch.Tensor]:
    """Prompt ids (4, P), completion ids (32, 48) drawn at random, advantages (32,)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
        )
        for q in QUESTIONS
    ]
    assert len({len(p) for p in prompts}) == 1, "prompts must tokenize to equal lengths"
    gen = torch.Generator().manual_seed(0)
    shape = (len(prompts) * GROUP, COMPLETION_TOKENS)
    completions = torch.randint(100, 40_000, shape, generator=gen)
    rewards = torch.randint(0, 2, (len(prompts), GROUP), generator=gen).float()
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    return {
        "prompt_ids": torch.tensor(prompts).repeat_interleave(GROUP, 0),  # (32, P)
        "completion_ids": completions,  # (32, 48)
        "advantages": advantages.flatten(),  # (32,)
    }


def best_of(step, repeats: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def looprl_trainer_and_batch(data: dict, model_dir: Path, train_cfg):
    """looprl's Trainer and `data` as its TrainBatch, behavior logprobs as an engine would
    give them (those of the initial weights). Also used by bench/train_step_thread.py."""
    from looprl.models import load_model
    from looprl.training.batch import TrainBatch
    from looprl.training.trainer import Trainer

    ids = torch.cat([data["prompt_ids"], data["completion_ids"]], 1)
    loss_mask = torch.zeros(ids.shape, dtype=torch.bool)
    loss_mask[:, data["prompt_ids"].shape[1] :] = True
    n = ids.shape[0]
    batch = TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=loss_mask,
        behavior_logprobs=torch.zeros(ids.shape),
        versions=torch.zeros_like(ids),
        advantages=data["advantages"],
        rewards=torch.zeros(n),
        group_index=torch.arange(n) // GROUP,
    )
    trainer = Trainer(load_model(model_dir), train_cfg)
    batch.behavior_logprobs = trainer.compute_logprobs(batch) * loss_mask
    return trainer, batch


def time_looprl(data: dict, model_dir: Path, bf16: bool, repeats: int) -> float:
    from looprl.config import TrainConfig

    cfg = TrainConfig(lr=LR, compute_dtype="bfloat16" if bf16 else "float32")
    trainer, batch = looprl_trainer_and_batch(data, model_dir, cfg)
    return best_of(lambda: trainer.train_step(batch), repeats)


def time_trl(data: dict, model_dir: Path, bf16: bool, checkpointing: bool, repeats: int) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        bf16=bf16,
        beta=0.0,
        num_generations=GROUP,
        per_device_train_batch_size=len(data["advantages"]),
        max_completion_length=COMPLETION_TOKENS,
        learning_rate=LR,
        max_grad_norm=1.0,
        gradient_checkpointing=checkpointing,
        report_to=[],
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": QUESTIONS}),
    )
    trainer.create_optimizer()
    acc = trainer.accelerator
    model, optimizer = acc.prepare(trainer.model, trainer.optimizer)
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by its training loop otherwise
    inputs = {
        "prompt_ids": data["prompt_ids"],
        "prompt_mask": torch.ones_like(data["prompt_ids"]),
        "completion_ids": data["completion_ids"],
        "completion_mask": torch.ones_like(data["completion_ids"]),
        "advantages": data["advantages"],
        "num_items_in_batch": torch.tensor(float(data["completion_ids"].numel())),
    }

    def step() -> None:
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, inputs)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = best_of(step, repeats)
    opt = getattr(optimizer, "optimizer", optimizer)
    return {"seconds": seconds, "optimizer": type(opt).__name__, "loss_type": args.loss_type}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="HF model folder")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="also write the rows here (bench/common.py)"
    )
    parser.add_argument("--trl-side", type=Path, help=argparse.SUPPRESS)  # batch file
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    if args.trl_side:  # running in .venv-trl: time TRL only, print one JSON line
        data = torch.load(args.trl_side)
        results = {
            f"{d}/{ckpt}": time_trl(data, args.model, d == "bfloat16", ckpt, args.repeats)
            for d in args.dtypes
            for ckpt in (True, False)
        }
        print(json.dumps(results))
        return

    from common import Row, write_result  # not in .venv-trl: it imports looprl

    from looprl.models import default_model_dir

    model_dir = args.model or default_model_dir()
    ensure_trl_venv()
    data = make_batch(model_dir)
    tokens = data["prompt_ids"].numel() + data["completion_ids"].numel()
    n, prompt_len = data["prompt_ids"].shape
    versions = trl_versions()
    print(f"batch: {n} sequences x ({prompt_len} prompt + {COMPLETION_TOKENS} completion tokens)")
    print(f"= {tokens} tokens; TRL side: {versions}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "batch.pt"
        torch.save(data, path)
        cmd = [str(TRL_PY), __file__, "--trl-side", str(path), "--model", str(model_dir)]
        cmd += ["--repeats", str(args.repeats), "--dtypes", *args.dtypes]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"TRL side failed:\n{out.stderr[-4000:]}")
        trl = json.loads(out.stdout.strip().splitlines()[-1])
    print("TRL: GC = gradient checkpointing (GRPOConfig's default: on)")
    print("| dtype | looprl tok/s | TRL tok/s (GC on) | TRL (GC off) | ratio | ratio (GC off) |")
    print("|---|---:|---:|---:|---:|---:|")
    rows, looprl_s = [], {}
    for dtype in args.dtypes:
        ours = time_looprl(data, model_dir, dtype == "bfloat16", args.repeats)
        gc_on, gc_off = trl[f"{dtype}/True"]["seconds"], trl[f"{dtype}/False"]["seconds"]
        cols = [tokens / ours, tokens / gc_on, tokens / gc_off]
        cells = " | ".join(f"{c:.0f}" for c in cols)
        print(f"| {dtype} | {cells} | {gc_on / ours:.2f}x | {gc_off / ours:.2f}x |", flush=True)
        looprl_s[dtype] = ours
        what = "bf16 autocast" if dtype == "bfloat16" else "float32"
        figure = f"train step, {n} x {prompt_len + COMPLETION_TOKENS} tokens, {what}"
        for trl_s, checkpointing in ((gc_on, "on, its default"), (gc_off, "off")):
            row = Row(
                figure=figure,
                looprl=tokens / ours,
                baseline=tokens / trl_s,
                baseline_name=f"TRL {versions['trl']} GRPOTrainer, grad checkpointing "
                + checkpointing,
                unit="tok/s",
                better="higher",
                note="loss + backward + clip + optimizer step, no generation",
            )
            rows.append(row)
    first = trl[f"{args.dtypes[0]}/True"]
    print(f"TRL: optimizer {first['optimizer']}, loss_type {first['loss_type']}")
    if args.json:
        details = {
            "tokens": tokens,
            "repeats": args.repeats,
            "looprl_seconds": looprl_s,
            "trl": trl,
            "trl_side_versions": versions,
        }
        write_result(args.json, "train_step_trl", rows, details)


if __name__ == "__main__":
    main()
