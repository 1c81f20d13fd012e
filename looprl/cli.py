"""The `looprl` command: train, rollout, serve, debug.

Each command parses its arguments, loads the config (failing before anything starts
when it is wrong), and calls one function of the library. Nothing here is needed to
use looprl from Python.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table
from rich.text import Text

from looprl.config import Config, ConfigError, load_config
from looprl.diagnostics import stacks
from looprl.runs.paths import RunPaths

app = typer.Typer(
    add_completion=False,
    no_args_is_help=False,
    help="Train LLM agents with reinforcement learning.",
)
debug_app = typer.Typer(help="Tools for finding out why something does not work.")
app.add_typer(debug_app, name="debug")
# Messages and logs. Markup is off here and in `_stdout`: what looprl prints is data
# (paths, values, `pip install 'looprl[envs]'`), in which rich would take `[envs]` for a
# style and drop it.
console = Console(stderr=True, markup=False)

ConfigArg = Annotated[str | None, typer.Argument(help="YAML config file (optional).")]
OverridesArg = Annotated[
    list[str] | None,
    typer.Argument(help="Dotted overrides, e.g. rollout.group_size=8 train.lr=2e-5."),
]


def _config(config: str | None, overrides: list[str] | None) -> Config:
    """Load the config; a first argument with '=' that is no file is an override.

    The working directory goes on sys.path (as with `python -m`), so a workflow given as
    "examples.my_agent:Agent" imports from where the command runs.
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    overrides = list(overrides or [])
    if config is not None and "=" in config and not Path(config).is_file():
        overrides.insert(0, config)
        config = None
    try:
        return load_config(config, overrides)
    except ConfigError as e:
        _error(e)
        raise typer.Exit(2) from None


def _setup_logging(level: str = "INFO", log_file: Path | None = None) -> None:
    handlers: list[logging.Handler] = [
        RichHandler(console=console, show_path=False, log_time_format="%H:%M:%S")
    ]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file)
        file_handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
        handlers.append(file_handler)
    logging.basicConfig(level=logging.WARNING, handlers=handlers, format="%(message)s", force=True)
    logging.getLogger("looprl").setLevel(level)
    for noisy in ("httpx", "uvicorn.access", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-tensor load/save bars say nothing useful here


@app.command()
def train(
    config: ConfigArg = None,
    overrides: OverridesArg = None,
    dry_run: Annotated[
        bool,
        typer.Option(help="Print the resolved config, run the start-up checks and exit."),
    ] = False,
    debug: Annotated[
        bool, typer.Option(help="Print the whole traceback of a start-up check that fails.")
    ] = False,
) -> None:
    """Train a policy. With no arguments: SmolLM2-135M on arithmetic, on CPU."""
    cfg = _config(config, overrides)
    if dry_run:
        print(cfg.to_yaml())
    # Before the training stack is imported (~7 s): a mistake is told in a second or two.
    _preflight(cfg, debug=debug, log_file=None if dry_run else RunPaths(cfg.run_dir).log)
    if dry_run:
        return
    from looprl.loop import train as run_training
    from looprl.precision import PrecisionError
    from looprl.rewards import RewardFailed
    from looprl.rewards.sandbox import SandboxUnavailable
    from looprl.rollout.failures import WorkflowFailed
    from looprl.runs.checkpoint import RecoverError
    from looprl.runs.stopping import Stopped
    from looprl.scheduling.reachability import NodeUnreachable

    _setup_logging(cfg.run.log_level, RunPaths(cfg.run_dir).log)
    stacks.install_stack_dump()
    stacks.write_pid(cfg.run_dir)
    try:
        summary = asyncio.run(run_training(cfg))
    except (RecoverError, PrecisionError, ConfigError) as e:
        _error(e)
        raise typer.Exit(2) from None
    except (RewardFailed, SandboxUnavailable, NodeUnreachable) as e:  # a judge down, no box
        _error(e)
        raise typer.Exit(1) from None
    except Stopped as e:
        console.print(str(e))
        raise typer.Exit(128 + e.signum) from None
    except WorkflowFailed:  # logged whole, with the workflow's traceback, by the loop
        _error(
            f"stopped: the workflow failed too often (above, and in {RunPaths(cfg.run_dir).log})"
        )
        raise typer.Exit(1) from None
    print(summary.line())


@app.command()
def sft(
    config: ConfigArg = None,
    overrides: OverridesArg = None,
    dry_run: Annotated[bool, typer.Option(help="Print the resolved config and exit.")] = False,
) -> None:
    """Supervised fine-tuning on a JSONL file of chats (`looprl sft chats.jsonl`, or
    sft.data_path=...): a warm start for RL, saved where `looprl train` saves."""
    args = [a for a in (config, *(overrides or [])) if a is not None]
    # A .jsonl argument is the data, not the YAML config.
    args = [f"sft.data_path={a}" if a.endswith(".jsonl") and "=" not in a else a for a in args]
    # The YAML config may come after the chats (`looprl sft chats.jsonl config.yaml`).
    config_file = next((a for a in args if "=" not in a), None)
    cfg = _config(config_file, [a for a in args if a is not config_file])
    if dry_run:
        print(cfg.to_yaml())
        return
    from looprl.commands.sft import check, run_sft

    try:
        check(cfg)
    except ValueError as e:
        _error(e)
        raise typer.Exit(2) from None
    _setup_logging(cfg.run.log_level, RunPaths(cfg.run_dir).log)
    stacks.install_stack_dump()
    stacks.write_pid(cfg.run_dir)
    try:
        summary = run_sft(cfg)
    except ValueError as e:  # the data: a missing file, no trainable chat
        _error(e)
        raise typer.Exit(2) from None
    print(summary.line())


@app.command("convert-checkpoint")
def convert_checkpoint(
    path: Annotated[Path, typer.Argument(help="A checkpoint folder (step_NNNNNN).")],
    trust_pickle: Annotated[
        bool,
        typer.Option(
            "--trust-pickle",
            help="Confirm you trust its files: converting unpickles them, which runs any "
            "code written into them.",
        ),
    ] = False,
) -> None:
    """Rewrite a checkpoint of the earlier pickled format as safetensors + JSON."""
    from looprl.runs.checkpoint import RecoverError, convert_pickled

    if not trust_pickle:
        _error(
            "converting unpickles trainer.pt and state.pkl, which runs any code written into "
            "them; pass --trust-pickle if nobody else could write there"
        )
        raise typer.Exit(2)
    try:
        convert_pickled(path)
    except RecoverError as e:
        _error(e)
        raise typer.Exit(2) from None
    print(f"converted {path}: trainer and state now in safetensors + JSON")


@app.command()
def rollout(
    config: ConfigArg = None,
    overrides: OverridesArg = None,
    out: Annotated[Path, typer.Option(help="Where to write trajectories (JSONL).")] = Path(
        "trajectories.jsonl"
    ),
    rows: Annotated[int, typer.Option(help="Dataset rows to run (each group_size times).")] = 8,
    split: Annotated[str, typer.Option(help="train or eval.")] = "train",
) -> None:
    """Run the workflow over dataset rows and write trajectories, without training."""
    cfg = _config(config, overrides)
    if split not in ("train", "eval"):
        _error(f"--split={split!r} must be 'train' or 'eval'")
        raise typer.Exit(2)
    from looprl.commands.collect import collect

    _setup_logging(cfg.run.log_level)
    result = asyncio.run(collect(cfg, rows=rows, split=split, out=out))
    _print_stats("rollout summary", result.stats())
    console.print(f"wrote {len(result.trajectories)} trajectories to {out}")


@app.command()
def serve(
    model: Annotated[str, typer.Option(help="Hugging Face model folder or 'default'.")] = (
        "default"
    ),
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    dtype: Annotated[
        str, typer.Option(help="auto (chosen from this machine), float32 or bfloat16.")
    ] = "auto",
    device: Annotated[
        str, typer.Option(help="auto (the first CUDA device, else the CPU), cpu, cuda, cuda:N.")
    ] = "auto",
    name: Annotated[str, typer.Option(help="Model name reported by /v1/models.")] = "policy",
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="LOOPRL_API_KEY",
            help="Require `Authorization: Bearer KEY` on every call (needed, or --no-auth, "
            "on an address other than loopback).",
        ),
    ] = None,
    no_auth: Annotated[
        bool, typer.Option(help="Serve a non-loopback address without a key, knowingly.")
    ] = False,
) -> None:
    """Serve a model over OpenAI-compatible /v1 endpoints (no sessions)."""
    from looprl.commands.serve import serve_model

    _setup_logging()
    try:
        serve_model(
            model,
            host=host,
            port=port,
            dtype=dtype,
            device=device,
            model_name=name,
            api_key=api_key,
            no_auth=no_auth,
        )
    except ValueError as e:
        _error(e)
        raise typer.Exit(2) from None


@app.command()
def doctor(
    config: ConfigArg = None,
    overrides: OverridesArg = None,
    debug: Annotated[
        bool, typer.Option(help="Print the whole traceback of a start-up check that fails.")
    ] = False,
) -> None:
    """Check the config as `looprl train` does before the model loads, and this machine
    for it: each failed check prints its fix."""
    from looprl.commands.doctor import run_checks

    cfg = _config(config, overrides)
    # The fix goes under the detail, not in a fourth column: the two share the width left
    # by name and status, so that a path or a command in them fits whole at 80 columns.
    table = _table("check", "status", "detail and fix")
    colors = {"ok": "green", "warn": "yellow", "fail": "red"}
    checks = run_checks(cfg)
    for c in checks:
        found = Text(c.detail)
        if c.fix:
            found.append(f"\nfix: {c.fix}", style="bold")
        table.add_row(c.name, Text(c.status, style=colors[c.status]), found)
    _stdout().print(table)
    for c in checks:
        if debug and c.traceback:
            console.print(c.traceback, end="", soft_wrap=True)
    failed = [c.name for c in checks if c.status == "fail"]
    if failed:
        console.print(Text(f"{len(failed)} check(s) failed: {', '.join(failed)}", style="red"))
        raise typer.Exit(1)


@app.command()
def show(
    run_dir: Annotated[Path, typer.Argument(help="Run dir (fileroot/experiment/trial).")],
    step: Annotated[int | None, typer.Option(help="Training step (default: latest).")] = None,
    index: Annotated[int, typer.Option(help="Row of the step (of --group if given).")] = 0,
    group: Annotated[str | None, typer.Option(help="Only the rows of this group id.")] = None,
) -> None:
    """Print a trained rollout: its calls, then its tokens coloured by the loss mask."""
    from looprl.commands.show import show_rollout
    from looprl.runs.trajectories import TrajectoryFileError

    try:
        show_rollout(run_dir, step=step, index=index, group=group, console=_stdout())
    except TrajectoryFileError as e:
        _error(e, soft_wrap=True)
        raise typer.Exit(1) from None


@app.command()
def view(
    run_dirs: Annotated[
        list[Path], typer.Argument(help="Run dir(s) (fileroot/experiment/trial); 2 to compare.")
    ],
    host: Annotated[
        str,
        typer.Option(
            help="Address to bind. The page is read-only and asks no key: on loopback only "
            "this machine reaches it; elsewhere anyone who reaches the port reads the runs."
        ),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8765,
) -> None:
    """Open a run in the browser: plots, config, each step's rollouts token by token."""
    from looprl.commands.view import view_runs

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        view_runs(run_dirs, host=host, port=port)
    except ValueError as e:
        _error(e)
        raise typer.Exit(2) from None


@debug_app.command("stacks")
def debug_stacks(
    target: Annotated[str, typer.Argument(help="A pid, or a run dir (its driver.pid).")],
) -> None:
    """Print the stack of every thread of a running looprl process, without stopping it."""
    try:
        print(stacks.dump_stacks(stacks.resolve_pid(target)))
    except (ValueError, TimeoutError) as e:
        _error(e)
        raise typer.Exit(2) from None


@debug_app.command("workflow")
def debug_workflow(
    config: ConfigArg = None,
    overrides: OverridesArg = None,
    base_url: Annotated[
        str | None,
        typer.Option(
            help="Any OpenAI-compatible server's /v1 URL; left out, the engine starts here "
            "and every call is recorded and shown."
        ),
    ] = None,
    api_key: Annotated[str, typer.Option(help="API key sent to --base-url.")] = "none",
    model: Annotated[str | None, typer.Option(help="Model name; default model.name.")] = None,
    concurrency: Annotated[int, typer.Option(help="Concurrent rollouts after the first.")] = 8,
) -> None:
    """Run the workflow once, then N at once: each call's transcript, the reward, the
    workflow's traceback, and what would break training (exit code 1)."""
    cfg = _config(config, overrides)
    from looprl.commands.workflow_check import ServerUnreachable, check_workflow

    _setup_logging(cfg.run.log_level)
    try:
        check = asyncio.run(
            check_workflow(
                cfg,
                base_url=base_url,
                api_key=api_key,
                model=model or cfg.model.name,
                concurrency=concurrency,
                console=_stdout(),
            )
        )
    except ServerUnreachable as e:
        _error(e)
        raise typer.Exit(1) from None
    _print_stats("workflow check", check.stats)
    for problem in check.problems:
        _error(problem)
    if check.problems:
        raise typer.Exit(1)


@debug_app.command("consistency")
def debug_consistency(
    config: ConfigArg = None,
    overrides: OverridesArg = None,
    samples: Annotated[int, typer.Option(min=1, help="Prompts to sample from (task rows).")] = 8,
    engines: Annotated[
        str, typer.Option(help="Engine backends to check, comma-separated: local,vllm,sglang.")
    ] = "local",
    worst: Annotated[int, typer.Option(min=1, help="Worst tokens listed per engine.")] = 5,
) -> None:
    """Engine logprobs vs the trainer's on the same sampled tokens: mean/max |diff|, KL,
    share of ratios outside [0.5, 2]."""
    cfg = _config(config, overrides)
    types = [t.strip() for t in engines.split(",") if t.strip()]
    unknown = [t for t in types if t not in ("local", "vllm", "sglang")]
    if not types or unknown:
        _error(f"--engines={engines!r}: name engines among local, vllm, sglang")
        raise typer.Exit(2)
    from looprl.commands.consistency import check_consistency
    from looprl.engines.base import EngineError

    _setup_logging(cfg.run.log_level)
    try:
        reports = asyncio.run(check_consistency(cfg, types, samples=samples, worst=worst))
    except EngineError as e:
        _error(e)
        raise typer.Exit(1) from None
    out = _stdout()
    summary = _table(*reports[0].summary(), title="logprobs: engine vs trainer, same tokens")
    for r in reports:
        summary.add_row(*(_cell(v) for v in r.summary().values()))
    out.print(summary)
    for r in reports:
        worst_table = _table(*r.worst[0].row(), title=f"worst tokens: {r.engine}")
        for w in r.worst:
            worst_table.add_row(*(_cell(v) for v in w.row().values()))
        out.print(worst_table)
    if cfg.sampling.top_k or cfg.sampling.top_p < 1:
        console.print(
            f"note: sampling.top_k={cfg.sampling.top_k}, top_p={cfg.sampling.top_p}: the "
            "trainer renormalizes over the same top-k / top-p set as the engine, as in "
            "training; the 'trainer untruncated' rows compare its full softmax instead"
        )


def _error(message: object, soft_wrap: bool = False) -> None:
    """'error: `message`' on stderr, wrapped at the width, or with `soft_wrap` on one line
    that the terminal wraps (`looprl show`'s errors are one line)."""
    console.print(Text.assemble(("error:", "red"), f" {message}"), soft_wrap=soft_wrap)


def _preflight(cfg: Config, *, debug: bool, log_file: Path | None) -> None:
    """Run the start-up checks (looprl/preflight.py): each problem as one block on
    stderr, its traceback in `log_file` and, with `debug`, on stderr; exit 2 if any."""
    from looprl import preflight

    problems = asyncio.run(preflight.check(cfg))
    if not problems:
        return
    for problem in problems:
        _error(problem.block())
        if debug:
            console.print(problem.traceback, end="", soft_wrap=True)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with log_file.open("a") as f:
            for problem in problems:
                f.write(f"{problem.block()}\n{problem.traceback}")
    where = f"; tracebacks in {log_file}" if log_file is not None else ""
    hint = "" if debug else f" (--debug prints their tracebacks{where})"
    console.print(f"{len(problems)} start-up check(s) failed{hint}")
    raise typer.Exit(2)


def _stdout() -> Console:
    """A console for a command's result, made when it prints so that it reads COLUMNS as
    set then (a test's CliRunner sets it after import)."""
    return Console(markup=False)


def _table(*headers: str, **options) -> Table:
    """A rich Table whose cells wrap, and fold a word longer than their column, where
    rich's default cuts it with '…': on a pipe rich assumes 80 columns."""
    table = Table(**options)
    for header in headers:
        table.add_column(header, overflow="fold")
    return table


def _cell(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _print_stats(title: str, stats: dict) -> None:
    table = _table("key", "value", title=title, show_header=False)
    for key, value in stats.items():
        if isinstance(value, dict):
            value = json.dumps(value) if value else "-"
        table.add_row(key, _cell(value))
    _stdout().print(table)


if __name__ == "__main__":  # pragma: no cover
    app()
