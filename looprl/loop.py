"""The training loop: rollouts -> batch -> train_step -> weights to the engine -> metrics.

Read top to bottom, `train` is the whole of RL in looprl. Everything it calls is a
part with its own file: the rollout controller (synchronous when
`rollout.max_head_offpolicyness = 0`, the same code path otherwise), the trainer, the
engine, the metrics; what they run on (models, device, precision, run paths, the
opened workflow and reward) is decided once by start-up (startup.py). Evaluation runs
the user's workflow on the held-out split (greedy, or sampled at eval.temperature) at
the start, every `eval.every_steps` steps and at the end.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml

from looprl import startup
from looprl.config import Config
from looprl.diagnostics.collapse import CollapseWatch, action_stats
from looprl.diagnostics.learning import LearningWatch
from looprl.diagnostics.watchdog import HangWatchdog, forget_processes
from looprl.rollout.controller import RolloutController
from looprl.rollout.truncation import truncation_stats
from looprl.runs import checkpoint as checkpoint_io
from looprl.runs.atomic import atomic_write_text
from looprl.runs.best import BestPolicy
from looprl.runs.metrics import Metrics
from looprl.runs.paths import RunPaths
from looprl.runs.stopping import MIN_STOP_GRACE_S, GracefulStop, Stopped, finish_or_stop
from looprl.runs.trajectories import TrajectoryWriter
from looprl.runtime import release_free_memory
from looprl.scheduling.parts import Parts, TrainerHandle, trainer_sampling
from looprl.scheduling.single_process import start_single_process
from looprl.startup import Setup
from looprl.tasks import load_task
from looprl.trackers import check_installed, start_trackers
from looprl.training.batch import build_batch
from looprl.workflows.protocol import Workflow

log = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    accuracy_before: float
    accuracy_after: float
    minutes: float
    steps: int
    run_dir: Path
    model_dir: Path
    # Where the run evaluated every eval.every_steps: its best evaluation (step 0's, the
    # untrained policy, when no step beat it) and where that policy was saved, if it was.
    best_accuracy: float | None = None
    best_step: int | None = None
    best_dir: Path | None = None
    finished_earlier: bool = False  # a rerun of a finished trial, which trained nothing

    def line(self) -> str:
        best = ""
        if self.best_step == 0:
            best = " (no step beat the untrained policy: nothing saved to best)"
        elif self.best_step is not None:
            where = f"saved to {self.best_dir}" if self.best_dir else "not saved"
            best = f" (best {100 * self.best_accuracy:.1f}% at step {self.best_step}, {where})"
        earlier = "This trial already finished: " if self.finished_earlier else ""
        return (
            f"{earlier}held-out accuracy: {100 * self.accuracy_before:.1f}% -> "
            f"{100 * self.accuracy_after:.1f}%{best} in {self.minutes:.1f} min "
            f"({self.steps} steps); model saved to {self.model_dir}"
        )

    def to_json(self) -> str:
        return json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in vars(self).items()})

    @classmethod
    def read(cls, path: Path) -> TrainSummary:
        """The summary a finished run wrote to `path` (RunPaths.summary)."""
        fields = json.loads(path.read_text())
        for key in ("run_dir", "model_dir", "best_dir"):
            fields[key] = Path(fields[key]) if fields[key] is not None else None
        return cls(**fields)


async def train(cfg: Config, *, show_progress: bool = True) -> TrainSummary:
    start = time.monotonic()
    check_installed(cfg)  # a tracker's missing package fails before anything starts
    setup = startup.start(cfg)  # so does a model that is not there, or a precision
    paths = setup.paths
    try:
        checkpoint = resume_point(cfg, paths)  # before anything is written into the run dir
    except Finished as finished:  # a retried job of a finished trial succeeds, training nothing
        return finished.summary
    cfg.save(paths)
    forget_processes(paths)  # those of an earlier run here would read as exited
    torch.manual_seed(cfg.run.seed)
    task = load_task(cfg.task)
    log.info(
        "Training %s for %d steps: %d prompts x %d samples per step (%s), task %s, run dir %s",
        setup.model.name,
        cfg.train.total_steps,
        cfg.rollout.batch_size,
        cfg.rollout.group_size,
        cfg.train.algorithm,
        cfg.task.name,
        paths.root,
    )
    log.info("%s", describe_loss(cfg))
    rows = DataStream(task.train, cfg.run.seed)
    first_step = 1 if checkpoint is None else checkpoint.step + 1
    async with (
        setup.open_workflow(task) as opened,
        start_parts(setup, opened.workflow) as parts,
    ):
        controller, engine, tokenizer = parts.controller, parts.engine, parts.tokenizer
        trainer = parts.trainer
        with (
            Metrics(
                paths,
                cfg.train.total_steps,
                show_progress=show_progress,
                resume=checkpoint is not None,
                trackers=start_trackers(cfg, paths, first_step=first_step),
                samples_per_step=cfg.metrics.samples_per_step,
                eval_temperature=cfg.eval.temperature,
            ) as metrics,
            GracefulStop(paths, cfg.recover.mode) as stop,
            HangWatchdog(
                paths, "driver", cfg.diagnostics, busy=controller.failures.activity
            ) as watchdog,
        ):
            if checkpoint is None:
                metrics.status("evaluating the initial policy")
                before = await finish_or_stop(
                    evaluate(controller, task.eval, cfg, metrics, step=0), stop, None, 0
                )
            else:
                await trainer.load_state_dict(checkpoint.trainer)
                await trainer.push_weights()
                before = restore(checkpoint, controller, rows, metrics)
            best = BestPolicy(cfg.eval, paths, trainer, tokenizer, metrics.records, checkpoint)
            saver = Saver(cfg, paths, trainer, controller, rows, metrics, last_step=first_step - 1)
            trajectories = TrajectoryWriter(paths, cfg.metrics, tokenizer, first_step)
            collapse = CollapseWatch(cfg.diagnostics)
            learning = LearningWatch.after(metrics.records)  # a resume's records: read
            for step in range(first_step, cfg.train.total_steps + 1):
                step_start = time.monotonic()
                metrics.status(f"rolling out {cfg.rollout.batch_size} x {cfg.rollout.group_size}")
                rollout = await finish_or_stop(  # a signal, a failing workflow stop the run
                    opened.checking_reward(  # so does a judge that is down
                        controller.prepare_batch(rows, first_position=rows.position),
                        cfg.reward.max_failure_rate,
                        cfg.rollout.batch_size * cfg.rollout.group_size,
                    ),
                    stop,
                    saver,
                    step - 1,
                )
                batch_wait_s = time.monotonic() - step_start  # the trainer idle, waiting
                # Before the update lets the next batch's rollouts start: this batch's
                # reward counters, and those of an evaluation run since the last step.
                reward_stats = opened.reward_stats()
                watchdog.beat()
                batch, batch_stats = build_batch(
                    rollout.trajectories,
                    cfg.train.algorithm,
                    tokenizer.pad_token_id,
                    cfg.train.overlong,
                    cfg.sampling.max_new_tokens,
                    credit=cfg.train.credit,
                    gamma=cfg.train.gamma,
                    gae_lambda=cfg.train.gae_lambda,
                    loss_agg=cfg.train.loss_agg,
                )
                metrics.status("training")
                train_stats = await train_step(trainer, batch, engine, pause=parts.pause_engine)
                # Before the next batch may start: a rollout admitted while the write awaits
                # would take a seed that a resume from this step's checkpoint replays.
                train_stats.update(await trajectories.write(step, rollout, batch, trainer))
                controller.notify_version()
                record = {
                    **rollout.stats(),
                    **reward_stats,
                    **batch_stats,
                    **train_stats,
                    **multi_turn_actions(rollout),
                    **truncation_stats(rollout.outcomes),
                    "response_length": batch_stats["num_sampled_tokens"] / len(batch.rewards),
                    "batch_wait_s": batch_wait_s,
                    "step_time_s": time.monotonic() - step_start,
                }
                metrics.log("train", step, record)
                stop.grace_s = max(record["step_time_s"], MIN_STOP_GRACE_S)
                collapse.check(step, record)
                metrics.log_warnings(learning.check(metrics.records))
                metrics.log_samples(step, rollout.trajectories, batch.advantages, tokenizer.decode)
                if stop.signal is not None or saver.due(step):
                    await saver.save(step)
                if stop.signal is not None:
                    raise Stopped(stop.signal, step, paths, cfg.recover.mode)
                if (
                    cfg.eval.every_steps
                    and step % cfg.eval.every_steps == 0
                    and (step < cfg.train.total_steps)
                ):
                    metrics.status("evaluating")
                    accuracy = await finish_or_stop(
                        evaluate(controller, task.eval, cfg, metrics, step=step), stop, saver, step
                    )
                    await best.offer(step, accuracy)
                    metrics.log_warnings(learning.check(metrics.records))
                watchdog.beat()  # the step's update, checkpoint and evaluation are done
            if cfg.checkpoint.keep_on_finish and saver.last_step < cfg.train.total_steps:
                await saver.save(cfg.train.total_steps)  # a longer rerun of this trial goes on
            metrics.status("final evaluation")
            after = await finish_or_stop(
                evaluate(controller, task.eval, cfg, metrics, step=cfg.train.total_steps),
                stop,
                saver,
                cfg.train.total_steps,
            )
            metrics.log_warnings(learning.check(metrics.records))
            plot = metrics.plot()
            model_dir = await trainer.save_model(tokenizer, setup.paths.model)
            await best.offer(cfg.train.total_steps, after)
    minutes = (time.monotonic() - start) / 60
    summary = TrainSummary(
        before, after, minutes, cfg.train.total_steps, paths.root, model_dir, **best.summary()
    )
    atomic_write_text(paths.summary, summary.to_json())  # what a rerun of this trial says
    # Only now, with the model saved and every part stopped: a run cut short before this
    # line (a signal, a crash) keeps its newest checkpoint to resume from.
    checkpoint_io.finish(paths, keep=cfg.checkpoint.keep_on_finish)
    log.info("Saved the trained policy to %s and the reward plot to %s", model_dir, plot)
    return summary


def multi_turn_actions(rollout) -> dict[str, float]:
    """The action distribution (diagnostics/collapse.py) of the replies of a batch in
    which some rollout made several model calls; nothing for single-call batches, whose
    first words are answers, not actions."""
    calls = [o.calls for o in rollout.outcomes]
    if not any(len(c) > 1 for c in calls):
        return {}
    return action_stats([call["reply"] for c in calls for call in c])


def describe_loss(cfg: Config) -> str:
    """One sentence naming the loss as it runs: objective, resolved clip range, mismatch
    correction, and the distribution the trainer's logprobs are of."""
    train, sampling = cfg.train, trainer_sampling(cfg)
    low, high = train.clip_range()
    correction = {
        "none": "not applied",
        "tis": f"truncated at {train.mismatch_cap:g}",
        "mis": f"weights outside [{train.mismatch_floor:g}, {train.mismatch_cap:g}] masked",
    }[train.mismatch_correction]
    credit = {
        "per_call": " (turns credited per_call: one baseline over every call of a group)",
        "per_turn": "",
        "episode": " (turns credited by episode: the episode return's advantage on every call)",
        "gae": f" (turns credited by gae: gamma {train.gamma:g}, lambda {train.gae_lambda:g})",
    }[train.credit]
    bonus = ""
    if train.entropy_coef > 0:
        below = f" when the batch entropy is below {train.entropy_floor:g}" * (
            train.entropy_floor > 0
        )
        bonus = f", entropy bonus {train.entropy_coef:g}{below}"
    return (
        f"Loss: {train.algorithm} advantages{credit}{bonus}, {train.objective} objective "
        f"with its ratio clipped to [{1 - low:g}, {1 + high:g}] (eps_clip={low:g}, "
        f"eps_clip_high={high:g}), "
        f"{train.loss_agg} aggregation; behavior weight ({train.mismatch_level} level) "
        f"{train.mismatch_correction}: {correction}; logprobs at temperature "
        f"{sampling['temperature']:g}, top_k {sampling['top_k']}, top_p {sampling['top_p']:g} "
        "(sampling's, forced on every training session)"
    )


def resume_point(cfg: Config, paths: RunPaths) -> checkpoint_io.Checkpoint | None:
    """The checkpoint to resume from under `recover.mode`, its config checked, or None."""
    found = None if cfg.recover.mode == "off" else checkpoint_io.load_latest(paths)
    if found is None:
        why = checkpoint_io.describe_missing(paths)
        if cfg.recover.mode == "require":
            raise checkpoint_io.RecoverError(f"recover.mode=require: {why}")
        if cfg.recover.mode == "auto" and paths.model.is_dir():
            # A finished trial: training it again here would replace its model.
            finished_run(cfg, paths, why)
        log.info("Starting a new run: %s", "recover.mode=off" if cfg.recover.mode == "off" else why)
        checkpoint_io.set_aside(paths)  # old or damaged ones never mix with the new
        return None
    checkpoint_io.check_config(found, cfg.model_dump(mode="json"), cfg.recover.allow_changes)
    if found.step >= cfg.train.total_steps:
        log.warning(
            "This trial already ran its %d steps (%s): only the final evaluation runs. Raise "
            "train.total_steps to go on, or use another run.trial_name or recover.mode=off "
            "to train again",
            found.step,
            found.path,
        )
    return found


def restore(
    checkpoint: checkpoint_io.Checkpoint,
    controller: RolloutController,
    rows: DataStream,
    metrics: Metrics,
) -> float:
    """Put the loop's state back as it was when `checkpoint` was saved; returns the
    held-out accuracy before training, from the restored metrics."""
    state = checkpoint.state
    controller.load_state_dict(state["controller"])
    rows.seek(state["data_position"])
    metrics.load_state_dict(state["metrics"])
    checkpoint_io.set_rng_state(state["rng"])
    log.info(
        "Resumed from %s: step %d, policy version %d, data position %d (epoch %d, row %d)",
        checkpoint.path,
        checkpoint.step,
        checkpoint.trainer["version"],
        rows.position,
        rows.epoch,
        rows.index,
    )
    evals = [r for r in metrics.records if r["kind"] == "eval" and r["step"] == 0]
    return evals[0].get("accuracy", 0.0) if evals else 0.0


class Saver:
    """When to save (every `save_every_steps`, every `save_every_secs`, after step 2) and
    what: the trainer's state and the loop's. `last_step`: the step of the checkpoint
    resumed from, 0 in a new run."""

    def __init__(
        self,
        cfg: Config,
        paths: RunPaths,
        trainer: TrainerHandle,
        controller,
        rows,
        metrics: Metrics,
        last_step: int,
    ):
        self.cfg, self.paths, self.trainer, self.controller = cfg, paths, trainer, controller
        self.rows, self.metrics = rows, metrics
        self.last, self.last_step = time.monotonic(), last_step

    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint
        return (
            # Early, once: a run that dies in its first minutes resumes instead of starting
            # over, and a checkpoint that cannot be written (disk full, no permission)
            # fails then, not only after the first save_every_secs.
            step == 2
            or (every.save_every_steps > 0 and step % every.save_every_steps == 0)
            or (every.save_every_secs > 0 and time.monotonic() - self.last >= every.save_every_secs)
        )

    async def save(self, step: int) -> None:
        position = self.controller.earliest_untrained_position()
        state = {
            "data_position": self.rows.position if position is None else position,
            "controller": self.controller.state_dict(),
            "metrics": self.metrics.state_dict(),
            "rng": checkpoint_io.rng_state(),
        }
        path = checkpoint_io.save(
            self.paths,
            step,
            await self.trainer.state_dict(),
            state,
            self.cfg.model_dump(mode="json"),
            self.cfg.checkpoint.keep_last,
        )
        self.last, self.last_step = time.monotonic(), step
        # What writing the checkpoint allocated goes back to the OS rather than stay in
        # the heap (tune_malloc keeps freed blocks): under Ray the driver fetched the full
        # state (1.6 GB for SmolLM2 with AdamW), which ran a 24 GB machine out of memory.
        release_free_memory()
        log.info("Saved recover checkpoint for step %d to %s", step, path)


class Finished(Exception):
    """This run directory holds a finished run of the same config (a job retried after
    it ended): `summary` is its result, read back."""

    def __init__(self, summary: TrainSummary):
        super().__init__(summary.line())
        self.summary = summary


def finished_run(cfg: Config, paths: RunPaths, why: str) -> None:
    """Under recover.mode=auto, `paths` holds a finished run (its model saved, its
    checkpoints removed; `why` says so): raise Finished with its summary when this config
    is the one it ran, so that the same command run again (a scheduler's retry) succeeds
    without training; else RecoverError, since training it further replaces its model
    and must be asked for."""
    how = "Train it again from scratch with recover.mode=off, or with another run.trial_name"
    if not paths.summary.is_file() or not paths.config.is_file():
        raise checkpoint_io.RecoverError(f"{paths.root} holds a finished run ({why}). {how}")
    earlier = yaml.safe_load(paths.config.read_text())
    refused, accepted = checkpoint_io.config_changes(earlier, cfg.model_dump(mode="json"), [])
    changes = [c for c in refused + accepted if not c.startswith("recover.")]
    if changes:
        raise checkpoint_io.RecoverError(
            f"{paths.root} holds a finished run ({why}), of another config:\n"
            + "\n".join(f"  {line}" for line in sorted(changes))
            + f"\n{how}"
        )
    summary = replace(TrainSummary.read(paths.summary), finished_earlier=True)
    log.info(
        "%s holds a finished run of this config: nothing to train (%s). %s",
        paths.root,
        summary.line(),
        how,
    )
    raise Finished(summary)


class DataStream:
    """Shuffled passes over `rows`, forever. `position` counts the rows drawn; `seek`
    goes back to one, so a resumed run draws what the interrupted one would have."""

    def __init__(self, rows: list[dict], seed: int):
        if not rows:
            raise ValueError("the training split has no rows")
        self.rows, self.seed = rows, seed
        self.seek(0)

    @property
    def position(self) -> int:
        return self.epoch * len(self.rows) + self.index

    def seek(self, position: int) -> None:
        self.epoch, self.index = divmod(position, len(self.rows))
        self._order = list(range(len(self.rows)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(self._order)

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if self.index == len(self.rows):
            self.seek(self.position)
        row = self.rows[self._order[self.index]]
        self.index += 1
        return row


async def train_step(
    trainer: TrainerHandle, batch, engine, *, pause: bool = True
) -> dict[str, float]:
    """One update, then the new weights to the engine (generations in flight go on).

    With `pause` (the engine shares the trainer's devices or cores: Parts.pause_engine)
    the engine pauses at a token boundary while the trainer holds them; without, it
    keeps generating and loads the new weights between two decode steps (a server: between
    requests). A local trainer steps in a worker thread, so that the event loop stays
    live: workflows, the gateway and every timeout go on meanwhile (with the step on the
    loop's thread, a client's 5 s connect timeout fired on a healthy request). The
    thread's own cost is within the machine's noise (`bench/train_step_thread.py`:
    medians 0.95-1.17x of inline); Python running on the loop meanwhile, e.g.
    asynchronous RL's rollouts, costs ~1.25x (GIL).
    """
    if pause:
        await engine.pause()
    try:
        stats = await trainer.train_step(batch)
        start = time.perf_counter()
        await trainer.push_weights()
        stats["weight_sync_s"] = time.perf_counter() - start
    finally:
        if pause:
            await engine.resume()
    return stats


@asynccontextmanager
async def start_parts(setup: Setup, workflow: Workflow) -> AsyncIterator[Parts]:
    """The parts of a training run under `scheduler.type`: everything in this process
    (single_process), or engine replicas and trainer ranks as Ray actors (ray)."""
    if setup.cfg.scheduler.type == "ray":
        from looprl.scheduling.ray import start_ray_actors  # imports ray, only when asked

        async with start_ray_actors(setup, workflow) as parts:
            yield parts
        return
    async with start_single_process(setup, workflow, train=True) as parts:
        yield parts


async def evaluate(
    controller: RolloutController, rows: list[dict], cfg: Config, metrics: Metrics, *, step: int
) -> float:
    """Held-out accuracy of the current policy through the user's workflow: greedy, or
    sampled at eval.temperature."""
    rows = rows[: cfg.eval.size] if cfg.eval.size else rows
    if not rows:
        log.warning("No held-out rows: accuracy is reported as 0; set task.eval_path")
        return 0.0
    result = await controller.rollout_batch(
        rows,
        group_size=1,
        sampling_overrides={
            "temperature": cfg.eval.temperature,
            "max_tokens": cfg.eval.max_new_tokens,
        },
    )
    stats = result.stats()
    metrics.log("eval", step, stats)
    return stats["accuracy"] if stats["accuracy"] == stats["accuracy"] else 0.0
