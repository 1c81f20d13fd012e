"""`looprl debug workflow`: the configured workflow run a few times, each model call
shown, and what would break training said plainly.

Without a base URL it starts the engine and the gateway here, on loopback (start-up,
then `start_single_process`, as `looprl rollout` does), and runs each rollout on a
gateway session under training's sampling, so every call is recorded: each call's
prompt tail, reply, tool calls and finish reason are printed (show.py's `print_call`),
then the reward. With a base URL it runs against that server (any OpenAI-compatible
one), which records nothing: rewards, latencies and errors only; a server that does not
answer stops it at once (`ServerUnreachable`, naming the command that starts one).

One rollout first, then `concurrency` at once; the first rollout's transcript is
printed, and the transcript of each later one whose outcome is new (an error type not
seen, a reply cut at max_tokens). Problems (`WorkflowCheck.problems`, exit code 1):
a workflow that raised (its own traceback, `run_workflow`'s, once per distinct error),
timed out, or returned a reward training cannot use (`check_reward`); a rollout that
returned a reward but made no model call (training drops it as NoTrajectory: the
trajectories are built here by `build_trajectories`, as the controller builds them);
no usable reward at all. A reply cut at max_tokens is flagged, not a problem.
Knows nothing of training.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from rich.console import Console
from rich.rule import Rule
from rich.text import Text

from looprl import startup
from looprl.commands.show import print_call, visible
from looprl.config import Config
from looprl.rollout.outcome import WorkflowRun, check_reward, run_in_session, run_workflow
from looprl.rollout.trajectory import build_trajectories, call_records
from looprl.scheduling.single_process import start_single_process
from looprl.tasks import load_task
from looprl.types import EpisodeReward, Interaction

# What a transcript keeps of a long text: its head and its tail, in characters.
MESSAGE_CHARS = 600  # a prompt message: what the model read last matters most
REPLY_CHARS = 2000
NEW_MESSAGES_SHOWN = 3  # of the messages a call added to the conversation

# What to change, for each kind of error a rollout can end with (by its type's name).
HINTS = {
    "NoTrajectory": "the workflow returned a reward but made no model call through the "
    "base_url and api_key it was given, so training has no tokens to learn from: build "
    "the agent's client from them (AsyncOpenAI(base_url=base_url, api_key=api_key))",
    "InvalidReward": "return a finite float, a dict of them by completion id, or None",
    "TimeoutError": "the workflow ran past rollout.timeout_s: raise it, or find where the "
    "agent waits",
}


class ServerUnreachable(Exception):
    """No server answers at the base URL given."""


@dataclass
class CheckedRollout:
    """One rollout as checked: its reward (None: none usable), the error training would
    count it under ("Type: message"), and its calls (None against a server that records
    none)."""

    run: WorkflowRun
    reward: float | None = None
    error: str | None = None
    calls: list[dict] | None = None  # trajectory.call_records
    output_tokens: list[int] = field(default_factory=list)  # per call

    @property
    def kind(self) -> str:
        """What this rollout came to, in a word: an error's type, 'cut' or 'ok'."""
        if self.error:
            return self.error.split(":", 1)[0]
        return "cut" if any(c["finish_reason"] == "length" for c in self.calls or []) else "ok"


@dataclass
class WorkflowCheck:
    """The summary table's values and the problems that would break training."""

    stats: dict[str, Any]
    problems: list[str]


async def check_workflow(
    cfg: Config,
    *,
    base_url: str | None,
    api_key: str,
    model: str,
    concurrency: int,
    console: Console,
) -> WorkflowCheck:
    """Run the workflow once, then `concurrency` times at once, on the engine started here
    (`base_url` None) or against `base_url`; print transcripts on `console`."""
    if base_url is not None:
        await check_reachable(base_url, cfg.model.path)
    setup = startup.start(cfg, train=False)
    task = load_task(cfg.task)
    rows = (task.train * (concurrency // max(len(task.train), 1) + 1))[: concurrency + 1]
    timeout_s = cfg.rollout.timeout_s
    async with setup.open_workflow(task) as opened:
        workflow = opened.workflow
        if base_url is not None:

            async def on_server(row: dict) -> CheckedRollout:
                run = await run_workflow(
                    workflow,
                    row,
                    base_url=base_url,
                    api_key=api_key,
                    model=model,
                    timeout_s=timeout_s,
                )
                return checked(run, None, None, cfg)

            console.print(
                Text(
                    f"Against {base_url}: it records no calls, so no transcript is shown "
                    "(leave out --base-url to see each call)",
                    style="dim",
                )
            )
            return await _check(on_server, rows, console)
        async with start_single_process(setup, workflow) as parts:
            gateway, overrides = parts.gateway, parts.controller.sampling_overrides

            async def on_session(row: dict) -> CheckedRollout:
                run, session, _ = await run_in_session(  # training's sampling
                    gateway, workflow, row, overrides, model=model, timeout_s=timeout_s
                )
                return checked(run, session.interactions, session.reward, cfg)

            return await _check(on_session, rows, console)


async def check_reachable(base_url: str, model_path: str) -> None:
    """Raise ServerUnreachable, with the command that starts a server, when nothing
    answers at `base_url` (any HTTP answer, an error status included, is a server)."""
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            await client.get(f"{base_url.rstrip('/')}/models")
    except httpx.TransportError as e:
        url = urlsplit(base_url)
        port = f" --port {url.port}" if url.port and url.port != 8000 else ""
        serve = f"looprl serve --model {model_path}{port}"
        raise ServerUnreachable(
            f"no server answers at --base-url {base_url} ({type(e).__name__}: {e}); start "
            f"one with `{serve}`, or leave out --base-url to start the engine here"
        ) from None


def checked(
    run: WorkflowRun,
    interactions: list[Interaction] | None,
    posted: float | dict[str, float] | None,
    cfg: Config,
) -> CheckedRollout:
    """What training would make of `run` and its session's `interactions` and `posted`
    reward (both None against a server that records nothing)."""

    def records(reward: float | dict[str, float]) -> list[dict] | None:
        if interactions is None:
            return None
        return call_records(
            interactions,
            reward,
            assignment=cfg.rollout.reward_assignment,
            discount=cfg.rollout.reward_discount,
        )

    tokens = [len(it.output_ids) for it in interactions or []]
    unscored = {}  # a reward dict naming no call: each call's reward shows as "-"
    if run.status != "completed":
        return CheckedRollout(run, None, run.error, records(unscored), tokens)
    reward, error = check_reward(run.value if run.value is not None else posted)
    if error or reward is None:
        return CheckedRollout(run, None, error, records(unscored), tokens)
    if isinstance(reward, EpisodeReward):
        per_call, scalar = reward.per_call, reward.total
    else:
        per_call = reward
        scalar = reward if isinstance(reward, float) else statistics.fmean(reward.values())
    if interactions is not None:
        trajectories, _, _ = build_trajectories(
            interactions,
            per_call,
            cfg.rollout.trajectory_mode,
            assignment=cfg.rollout.reward_assignment,
            discount=cfg.rollout.reward_discount,
        )
        if not trajectories:
            error = (
                f"NoTrajectory: reward {scalar:.4g} returned, but no model call with a reply "
                f"was recorded (calls: {len(interactions)}); training drops this rollout"
            )
            return CheckedRollout(run, None, error, records(per_call), tokens)
    return CheckedRollout(run, scalar, None, records(per_call), tokens)


async def _check(rollout, rows: list[dict], console: Console) -> WorkflowCheck:
    """The first row alone, then the rest at once; each printed as it is judged."""
    printer = _Printer(console)
    console.print(Text("One rollout first:", style="bold"))
    first = await rollout(rows[0])
    printer.rollout(1, first)
    console.print(Text(f"Now {len(rows) - 1} rollouts at once:", style="bold"))
    rest = await asyncio.gather(*(rollout(r) for r in rows[1:]))
    for number, result in enumerate(rest, start=2):
        printer.rollout(number, result)
    return _summary([first, *rest])


class _Printer:
    """Prints rollouts: a transcript for the first and for each later one whose outcome
    (`CheckedRollout.kind`) is new, one line for the others; a traceback once per error."""

    def __init__(self, console: Console):
        self.console = console
        self.kinds: set[str] = set()
        self.tracebacks: set[tuple[str, ...]] = set()

    def rollout(self, number: int, result: CheckedRollout) -> None:
        out = self.console
        new = result.kind not in self.kinds
        self.kinds.add(result.kind)
        if new and result.calls is not None:
            out.print(Rule(f"rollout {number}", style="bold"))
            _transcript(out, result)
        out.print(_verdict(number, result))
        trace = result.run.traceback
        if trace:
            frames = tuple(line for line in trace.splitlines() if line.startswith("  File "))
            if (result.kind, frames) not in self.tracebacks:
                self.tracebacks.add((result.kind, frames))
                out.print(Text(trace.rstrip(), style="red"))
        elif result.error and new:
            hint = HINTS.get(result.kind)
            if hint:
                out.print(Text(f"  fix: {hint}", style="red"))


def _transcript(console: Console, result: CheckedRollout) -> None:
    """Each call: the messages it added (the first call's last message), clipped, the
    reply, tool calls, finish reason and reward; a reply cut at max_tokens flagged."""
    calls = visible(result.calls)
    if not calls:
        console.print(Text("no model call was recorded", style="red"))
    seen = 0  # messages of the conversation shown or known from the previous call
    for k, (call, tokens) in enumerate(zip(calls, result.output_tokens, strict=True)):
        messages = call["messages"]
        added = len(messages) - seen if 0 < seen <= len(messages) else 1
        count = min(max(added, 1), NEW_MESSAGES_SHOWN, len(messages))
        shown = [
            {**m, "content": _clip(m.get("content"), MESSAGE_CHARS)}
            for m in messages[len(messages) - count :]
        ]
        clipped = {**call, "messages": shown, "reply": _clip(call["reply"], REPLY_CHARS)}
        print_call(console, k + 1, clipped, left_out=len(messages) - len(shown))
        if call["finish_reason"] == "length":
            console.print(
                Text(
                    f"  the reply was cut at max_tokens ({tokens} tokens): raise the "
                    "max_tokens the agent passes (or sampling.max_new_tokens, its default)",
                    style="yellow",
                )
            )
        seen = len(messages) + 1  # its reply comes back as the next call's message


def _clip(text: Any, chars: int) -> Any:
    """`text` when short (or not a string), else its head and tail around a note."""
    if not isinstance(text, str) or len(text) <= chars:
        return text
    head, tail = chars // 4, chars - chars // 4
    return f"{text[:head]} [... {len(text) - chars} characters ...] {text[-tail:]}"


def _verdict(number: int, result: CheckedRollout) -> Text:
    calls = "" if result.calls is None else f", {len(result.calls)} call(s)"
    took = f"{result.run.elapsed_s:.2f} s{calls}"
    if result.error:
        return Text(f"rollout {number}: {result.error} ({took})", style="red")
    if result.reward is None:
        return Text(f"rollout {number}: returned None: training skips it ({took})", "yellow")
    cut = " (a reply cut at max_tokens)" if result.kind == "cut" else ""
    return Text(f"rollout {number}: reward {result.reward:.4g}{cut} ({took})", style="green")


def _summary(results: list[CheckedRollout]) -> WorkflowCheck:
    latencies = sorted(r.run.elapsed_s for r in results)
    rewards = [r.reward for r in results if r.reward is not None]
    errors = Counter(r.kind for r in results if r.error)

    def pct(p: float) -> float:
        return latencies[min(int(p * len(latencies)), len(latencies) - 1)]

    stats: dict[str, Any] = {
        "rollouts": len(results),
        "rewards": len(rewards),
        "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
        "returned_none": sum(r.reward is None and not r.error for r in results),
        "latency_p50_s": pct(0.5),
        "latency_p90_s": pct(0.9),
        "latency_max_s": latencies[-1],
        "errors": dict(errors),
    }
    if results[0].calls is not None:  # recorded on gateway sessions
        stats["calls"] = sum(len(r.calls or []) for r in results)
        stats["cut_at_max_tokens"] = sum(
            c["finish_reason"] == "length" for r in results for c in r.calls or []
        )
    problems = [
        f"{count} of {len(results)} rollouts ended with {kind} (see above)"
        for kind, count in errors.items()
    ]
    if not rewards and not errors:
        problems.append("no rollout returned a reward: training would have nothing to learn")
    return WorkflowCheck(stats, problems)
