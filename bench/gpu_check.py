"""The GPU check: looprl on one CUDA GPU, every figure in one JSON file (docs/gpu.md).

`bench/gpu_check.sh` runs it on a GPU machine that has nothing of looprl's installed and
no network, in two calls (the default model's GGUF is too big for one call's 64 MiB):
stage `a` checks the machine and runs `make test-gpu`, stage `b` everything that needs
the default model. Each step runs in its own process under a timeout and prints its
figures as one JSON line last; `report` runs a stage's steps one after another, each
whether or not the one before it failed, and rewrites the JSON file after every step
(so a check cut short still leaves its figures), with each step's status, seconds,
figures, and the tail of its output when it failed.

Steps, and the goals on one H100 they are held against:
- env: Python, torch, CUDA, transformers, the GPU (nvidia-smi), where each carried
  package was imported from.
- tests: `make test-gpu` (tests/gpu).
- model: the default model converted from the carried GGUF (models.default_model_dir).
- default-job: `looprl train` with the default config (run.device=auto): held-out
  accuracy before and after, minutes; goal: +30 points or more in 2 min or less.
- train-step: one `Trainer.train_step` on the default job's batch (bench/train_step.py),
  in the precision start-up decides: seconds, tokens/s, peak GPU memory.
- weight-sync: the trainer's weights into the local engine on the same device
  (`update_weights`), median of several; goal: 50 ms or less.
- engine: the local engine against Hugging Face `generate` on the same device, in the
  engine's dtype, 256 chat prompts x 512 new tokens, sampling at temperature 1, EOS
  ignored (bench/engine.py's prompts and sampling); goal: 5x HF's tokens/s or more.

    python3 bench/gpu_check.py report --stage b --out $OUT/gpu_check.json   # via gpu_check.sh
    .venv/bin/python bench/gpu_check.py report --stage b --device cpu --quick --out /tmp/c.json
    python3 bench/gpu_check.py engine --device cuda                          # one step
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = "GPU_CHECK_RESULT "  # a step's last line: this marker, then its figures as JSON
CARRIED = [  # bench/gpu_bundle.sh's packages: where each is imported from tells the story
    "pydantic", "pydantic-core", "fastapi", "starlette", "uvicorn", "openai", "httpx2",
    "jiter", "gguf", "math-verify", "typer", "typing-extensions", "pytest-asyncio",
]  # fmt: skip
IMAGE = ["torch", "transformers", "tokenizers", "safetensors", "accelerate", "peft",
         "huggingface-hub", "numpy", "pyarrow", "pytest", "pytest-timeout", "anyio",
         "httpx", "h11", "click", "rich", "sympy", "matplotlib"]  # fmt: skip
GOALS = {
    "default_job": "held-out accuracy +30 points or more in 2 min or less (one H100)",
    "engine": "local engine 5x HF generate's tokens/s or more, 256 x 512 (one H100)",
    "weight_sync": "trainer -> engine update_weights 50 ms or less, 135M model (one H100)",
}
# Steps of each stage: (name, seconds at most, seconds it needs to be worth starting).
STAGES = {
    "a": [("env", 60, 10), ("tests", 180, 30)],
    "b": [
        ("env", 60, 10),
        ("model", 150, 30),
        ("default-job", 240, 60),
        ("train-step", 120, 30),
        ("weight-sync", 90, 20),
        ("engine", 180, 45),
    ],
}
QUICK_JOB = ["train.total_steps=2", "eval.every_steps=0", "task.eval_size=16",
             "rollout.batch_size=2", "rollout.group_size=4"]  # fmt: skip


# ---- steps: each runs in its own process and returns its figures ----


def step_env(args) -> dict:
    import torch
    import transformers

    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cpu_cores": os.cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "bf16": torch.cuda.is_bf16_supported(),
        }
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,driver_version,memory.total,clocks.max.sm"
        smi = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True
        )
        found["nvidia_smi"] = (smi.stdout or smi.stderr).strip()
    found["packages"] = {name: _where_installed(name) for name in CARRIED + IMAGE}
    try:  # everything `looprl train` imports at start; a missing wheel shows here
        import looprl.cli  # noqa: F401
    except Exception as e:
        found["looprl_imports"] = f"{type(e).__name__}: {e}"
    else:
        found["looprl_imports"] = "ok"
    return found


def _where_installed(name: str) -> str:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return "missing"
    folder = Path(str(dist.locate_file(""))).resolve()
    carried = ROOT / ".gpu-state" / "site"
    origin = "carried" if folder == carried.resolve() else str(folder)
    return f"{dist.version} ({origin})"


def step_model(args) -> dict:
    from looprl.models import cache_dir, default_model_dir

    target = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    converted = not (target / "model.safetensors").is_file()
    start = time.perf_counter()
    folder = default_model_dir()
    size = sum(f.stat().st_size for f in folder.iterdir())
    return {
        "folder": str(folder),
        "converted_now": converted,
        "seconds": round(time.perf_counter() - start, 1),
        "mib": round(size / 2**20, 1),
    }


def _setup(args, *overrides: str):
    """Start-up's decisions for the default config on args.device, as `looprl train`
    makes them (run dir in a temporary folder)."""
    from looprl import startup
    from looprl.config import load_config

    runs = tempfile.mkdtemp(prefix="gpu-check-")
    cfg = load_config(None, [f"run.device={args.device}", f"run.fileroot={runs}", *overrides])
    return startup.start(cfg)


def _peak_mib(device) -> float | None:
    """The allocator's peak on `device` since `reset_peak`, in MiB (None off a GPU)."""
    from looprl.memory import peak_allocated

    peak = peak_allocated(device)
    return None if peak is None else round(peak / 2**20, 1)


def _bench(name: str):
    """A module of bench/ (a folder of scripts, not a package)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def step_train_step(args) -> dict:
    import torch

    from looprl.memory import reset_peak
    from looprl.scheduling.parts import build_trainer

    setup = _setup(args)
    policy = setup.model.load(setup.cfg.model.dtype).to(setup.device)
    trainer = build_trainer(setup, policy)
    batch = _bench("train_step").default_job_batch(setup.model.tokenizer)
    if args.quick:  # two of its eight groups, both with rewards that differ
        batch = batch.select(torch.arange(16, 32))
    synchronize = _bench("engine").synchronize
    trainer.train_step(batch)  # warm-up: kernels chosen, optimizer state allocated
    synchronize(setup.device)
    reset_peak(setup.device)
    times, stats = [], {}
    for _ in range(args.repeats):
        start = time.perf_counter()
        stats = trainer.train_step(batch)
        synchronize(setup.device)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {
        "device": str(setup.device),
        "precision": setup.precision.train.describe(),
        "memory_plan": setup.memory.describe(),
        "batch": f"{batch.num_sequences} rows, {batch.num_tokens} tokens "
        f"({batch.num_sampled_tokens} sampled)",
        "step_s": round(step_s, 4),
        "step_s_all": [round(t, 4) for t in times],
        "batch_tokens_per_s": round(batch.num_tokens / step_s),
        "trainer_tokens_per_s": round(stats.get("tokens_per_s", 0.0)),
        "loss": stats.get("loss"),
        "peak_gpu_mib": _peak_mib(setup.device),
    }


def step_weight_sync(args) -> dict:
    """bench/weight_sync.py's measurement on start-up's decisions for args.device."""
    return asyncio.run(_bench("weight_sync").measure(_setup(args), args.repeats))


def step_engine(args) -> dict:
    from looprl.engines.local.engine import LocalEngine
    from looprl.memory import reset_peak
    from looprl.models import DTYPES

    bench_engine = _bench("engine")
    prompts_n, new_tokens = (16, 32) if args.quick else (args.prompts, args.new_tokens)
    setup = _setup(args)
    decided = setup.precision.engine
    tokenizer = setup.model.tokenizer
    prompts = bench_engine.make_prompts(tokenizer, prompts_n)
    kv_tokens = prompts_n * (max(map(len, prompts)) + new_tokens)
    model = setup.model.load("float32").to(setup.device)
    engine = LocalEngine(
        model,
        eos_token_ids=[],  # exactly new_tokens per row, as HF with eos_token_id None
        dtype=decided.dtype,
        weight_layout=decided.weight_layout,
        kernels=decided.kernels,
        graphs="cuda" if decided.cuda_graphs else "off",
        max_batch_size=prompts_n,
        max_tokens_per_batch=max(kv_tokens, 256),
    )
    hf = model.to(DTYPES[decided.dtype])  # the engine holds its own copy
    hf.generation_config.eos_token_id = None
    pad = tokenizer.pad_token_id

    async def run() -> dict:
        bench_engine.time_hf_generate(hf, prompts[:4], 8, pad)  # warm-ups
        await bench_engine.time_engine(engine, prompts, 8)
        reset_peak(setup.device)
        hf_s = min(
            bench_engine.time_hf_generate(hf, prompts, new_tokens, pad) for _ in range(args.repeats)
        )
        hf_peak = _peak_mib(setup.device)
        reset_peak(setup.device)
        engine_s = min(
            [
                await bench_engine.time_engine(engine, prompts, new_tokens)
                for _ in range(args.repeats)
            ]
        )
        engine_peak = _peak_mib(setup.device)
        graphs = getattr(engine._runner, "graphs", None)
        await engine.stop()
        tokens = prompts_n * new_tokens
        return {
            "device": str(setup.device),
            "workload": f"{prompts_n} prompts x {new_tokens} new tokens, temperature 1",
            "engine": decided.describe(),
            "hf_s": round(hf_s, 2),
            "engine_s": round(engine_s, 2),
            "hf_tokens_per_s": round(tokens / hf_s),
            "engine_tokens_per_s": round(tokens / engine_s),
            "engine_vs_hf": round(hf_s / engine_s, 2),
            "cuda_graphs_captured": graphs.captures if graphs else None,
            "cuda_graphs_failed": graphs.failed if graphs else None,
            "hf_peak_gpu_mib": hf_peak,
            "engine_peak_gpu_mib": engine_peak,
        }

    return asyncio.run(run())


STEPS = {
    "env": step_env,
    "model": step_model,
    "train-step": step_train_step,
    "weight-sync": step_weight_sync,
    "engine": step_engine,
}


# ---- the report: the steps of a stage, each in its own process ----


def run_process(argv: list[str], timeout_s: float, env: dict, log) -> tuple[str, str, float]:
    """Run `argv` in its own process group, killed whole at `timeout_s`; its output is
    appended to `log`. Returns (status, output, seconds)."""
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
    except OSError as e:
        return f"failed to start: {e}", "", time.monotonic() - start
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        status = f"timed out after {timeout_s:.0f} s"
    log.write(f"\n===== {' '.join(argv)}: {status} =====\n{output}")
    log.flush()
    return status, output, time.monotonic() - start


def _last_result(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith(RESULT)]
    return json.loads(lines[-1][len(RESULT) :]) if lines else {}


def run_step(name: str, args, timeout_s: float, env: dict, log) -> dict:
    python = sys.executable
    if name == "tests":
        return run_tests(args, timeout_s, env, log)
    if name == "default-job":
        return run_default_job(args, timeout_s, env, log)
    argv = [python, str(Path(__file__).resolve()), name, "--device", args.device]
    argv += ["--quick"] if args.quick else []
    status, output, seconds = run_process(argv, timeout_s, env, log)
    entry = {"status": status, "seconds": round(seconds, 1), "result": _last_result(output)}
    if status != "ok":
        entry["output_tail"] = output[-3000:]
    return entry


def run_tests(args, timeout_s: float, env: dict, log) -> dict:
    env = dict(env)
    if args.device == "cpu":
        env["LOOPRL_GPU_TESTS_ON"] = "cpu"
    argv = ["make", "--no-print-directory", "test-gpu", f"PYTHON={sys.executable}"]
    if shutil.which("make") is None:  # the same command as the Makefile's test-gpu
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
        argv += ["-m", "gpu", "tests/gpu"]
    status, output, seconds = run_process(argv, timeout_s, env, log)
    summary = [line for line in output.splitlines() if " in " in line and (
        "passed" in line or "failed" in line or "skipped" in line or "error" in line)]  # fmt: skip
    entry = {"status": status, "seconds": round(seconds, 1), "command": " ".join(argv)}
    entry["result"] = {"summary": summary[-1].strip("= ") if summary else None}
    if status != "ok":
        entry["output_tail"] = output[-4000:]
    return entry


def run_default_job(args, timeout_s: float, env: dict, log) -> dict:
    runs = Path(tempfile.mkdtemp(prefix="gpu-check-runs-"))
    argv = [sys.executable, "-m", "looprl.cli", "train", "recover.mode=off",
            f"run.fileroot={runs}"]  # fmt: skip
    argv += [] if args.device == "auto" else [f"run.device={args.device}"]
    argv += QUICK_JOB if args.quick else []
    status, output, seconds = run_process(argv, timeout_s, env, log)
    entry = {"status": status, "seconds": round(seconds, 1), "command": " ".join(argv[1:])}
    entry["result"] = job_figures(runs / "default" / "trial0", output)
    if status != "ok":
        entry["output_tail"] = output[-3000:]
    return entry


def job_figures(run_dir: Path, output: str) -> dict:
    """Held-out accuracy before and after, steps, and minutes, from the run's
    metrics.jsonl (whatever it holds, if the job was cut short) and its log."""
    figures: dict = {}
    finals = [line for line in output.splitlines() if line.startswith("held-out accuracy:")]
    if finals:
        figures["final_line"] = finals[-1]
    log = run_dir / "train.log"  # start-up's decisions: device, precision, memory plan
    if log.is_file():
        lines = log.read_text(errors="replace").splitlines()
        figures["start_up"] = [ln.split(" looprl.startup: ", 1)[1] for ln in lines
                               if " looprl.startup: " in ln]  # fmt: skip
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return figures
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    evals = [r for r in records if r.get("kind") == "eval"]
    train = [r for r in records if r.get("kind") == "train"]
    if evals:
        figures["accuracy_before"] = evals[0].get("accuracy")
        figures["accuracy_after"] = evals[-1].get("accuracy")
        figures["accuracy_by_step"] = {str(r["step"]): r.get("accuracy") for r in evals}
        if len(evals) > 1 and evals[0].get("accuracy") is not None:
            gain = evals[-1]["accuracy"] - evals[0]["accuracy"]
            figures["gain_points"] = round(100 * gain, 1)
    figures["train_steps"] = len(train)
    if records:
        first = records[0]["time"] - records[0].get("elapsed_s", 0.0)
        figures["minutes_first_eval_to_last_record"] = round((records[-1]["time"] - first) / 60, 2)
    if train:
        keys = ("train_time_s", "rollout_tokens_per_s", "tokens_per_s", "step_time_s")
        figures["last_train_step"] = {k: train[-1][k] for k in keys if k in train[-1]}
    return figures


def summary(report: dict) -> list[str]:
    """One line per goal: the figure, the goal, met or not (judged on a full run on a GPU
    only: a quick or CPU run checks the plumbing)."""
    steps, lines = report["steps"], []
    judged = not report["quick"] and report["device_setting"] != "cpu"

    def verdict(met: bool) -> str:
        return ("met" if met else "NOT met") if judged else "not judged (quick or CPU run)"

    job = steps.get("default-job", {}).get("result", {})
    if "gain_points" in job:
        minutes = steps["default-job"]["seconds"] / 60
        met = job["gain_points"] >= 30 and minutes <= 2 and steps["default-job"]["status"] == "ok"
        lines.append(
            f"default job: {100 * job['accuracy_before']:.0f}% -> "
            f"{100 * job['accuracy_after']:.0f}% ({job['gain_points']:+.0f} points) in "
            f"{minutes:.1f} min of wall time, start-up included; goal: "
            f"{GOALS['default_job']}: {verdict(met)}"
        )
    engine = steps.get("engine", {}).get("result", {})
    if "engine_vs_hf" in engine:
        met = engine["engine_vs_hf"] >= 5
        lines.append(
            f"engine: {engine['engine_tokens_per_s']} tok/s vs HF {engine['hf_tokens_per_s']} "
            f"({engine['engine_vs_hf']}x, {engine['workload']}); goal: {GOALS['engine']}: "
            f"{verdict(met)}"
        )
    sync = steps.get("weight-sync", {}).get("result", {})
    if "update_weights_ms_median" in sync:
        met = sync["update_weights_ms_median"] <= 50
        lines.append(
            f"weight sync: {sync['update_weights_ms_median']} ms median; goal: "
            f"{GOALS['weight_sync']}: {verdict(met)}"
        )
    train = steps.get("train-step", {}).get("result", {})
    if "step_s" in train:
        lines.append(
            f"train step: {train['step_s']} s, {train['batch_tokens_per_s']} batch tokens/s, "
            f"peak {train['peak_gpu_mib']} MiB ({train['precision']})"
        )
    for name, step in steps.items():
        if step["status"] != "ok":
            lines.append(f"{name}: {step['status']}")
    return lines


def report(args) -> None:
    began = time.monotonic()
    deadline = began + args.budget_s
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"PYTHONUNBUFFERED": "1", "COLUMNS": "160"}  # rich logs: fewer wraps
    doc: dict = {
        "check": "looprl GPU check (bench/gpu_check.py)",
        "stage": args.stage,
        "device_setting": args.device,
        "quick": args.quick,
        "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "goals": GOALS,
        "notes": [
            "the engine step runs bench/engine.py's prompts and timings (time_hf_generate, "
            "time_engine) on the device at 256 x 512, with start-up's engine precision"
        ],
        "steps": {},
    }
    if args.stage_a:
        previous = Path(args.stage_a)
        doc["stage_a"] = json.loads(previous.read_text()) if previous.is_file() else None
    steps = list(STAGES[args.stage])
    if args.stage == "b" and not (doc.get("stage_a") or {}).get("steps", {}).get("tests"):
        steps.insert(1, ("tests", 180, 30))  # stage a's result is not there: run them here
    with open(args.log, "a") if args.log else open(os.devnull, "w") as log:
        for name, cap_s, least_s in steps:
            left = deadline - time.monotonic()
            if left < least_s:
                doc["steps"][name] = {"status": f"not run: {left:.0f} s of the budget left"}
            else:
                print(f"== {name} (at most {min(cap_s, left):.0f} s)", flush=True)
                step = doc["steps"][name] = run_step(name, args, min(cap_s, left), env, log)
                figures = json.dumps(step.get("result"))[:600]
                print(f"   {step['status']}, {step.get('seconds')} s: {figures}", flush=True)
            doc["wall_s"] = round(time.monotonic() - began, 1)
            doc["summary"] = summary(doc)
            out.write_text(json.dumps(doc, indent=2) + "\n")
    print("\n".join(["== summary", *doc["summary"]]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=[*STEPS, "report"])
    parser.add_argument(
        "--device", default="auto", help="a run.device value: auto (the GPU), cpu, cuda:N"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (a dry run on a CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per measurement")
    parser.add_argument("--prompts", type=int, default=256, help="engine: distinct prompts")
    parser.add_argument("--new-tokens", type=int, default=512, help="engine: tokens per prompt")
    parser.add_argument("--stage", choices=sorted(STAGES), default="b", help="report: which steps")
    parser.add_argument("--out", help="report: the JSON file")
    parser.add_argument("--log", help="report: a file that gets every step's whole output")
    parser.add_argument("--stage-a", help="report: stage a's JSON, copied into stage b's")
    parser.add_argument("--budget-s", type=float, default=470, help="report: seconds in all")
    args = parser.parse_args()
    if args.step == "report":
        if not args.out:
            parser.error("report needs --out FILE")
        report(args)
        return
    if args.repeats is None:
        repeats = {"train-step": (3, 1), "weight-sync": (10, 3), "engine": (1, 1)}
        args.repeats = repeats.get(args.step, (1, 1))[args.quick]
    figures = STEPS[args.step](args)
    print(RESULT + json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
