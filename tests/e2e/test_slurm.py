"""The sbatch template (examples/slurm/looprl.sbatch) submitted to a real Slurm: a one-node
cluster of this machine (tests/support/slurm.py), where the job starts a Ray head with
`srun`, waits for it, and runs `looprl train` of the tiny model with scheduler.type=ray.

The job gets the test's environment as a user's job gets theirs (sbatch's default
--export=ALL): PATH with this venv's bin, where `ray`, `python` and `looprl` are. Ray
announces 127.0.0.1 (LOOPRL_NET_IFACE=lo), the one address a one-machine cluster needs.

Stopping: `scancel --batch --signal=TERM` signals the batch script alone, which passes the
SIGTERM on to `looprl train` and waits for it to save a checkpoint after its step before
stopping Ray; a plain `scancel` also signals the Ray node's step, whose actors die at once,
so the run keeps only its last checkpoint. The same sbatch line resumes either.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
import yaml

from looprl.engines.servers.process import free_port
from looprl.runs import checkpoint as checkpoint_io
from tests.support.slurm import Cluster, SlurmError, one_node_cluster, skip_reason
from tests.support.tiny_run import metrics_records, tiny_run_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "examples" / "slurm" / "looprl.sbatch"
JOB_TIMEOUT_S = 240  # a job here takes ~50 s: Ray's start ~15 s, looprl's ~20 s
STEPS = 20  # of the cancelled run: the SIGTERM lands well before its end (0.3 s a step)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Cluster:
    why = skip_reason()
    if why:
        pytest.skip(why)
    with contextlib.ExitStack() as stack:
        try:
            cluster = stack.enter_context(one_node_cluster(tmp_path_factory.mktemp("slurm")))
        except SlurmError as e:  # a container that denies what slurmd needs
            pytest.skip(f"Slurm would not start here: {e}")
        yield cluster


def _config_file(model_dir: Path, root: Path, *overrides: str) -> Path:
    """The tiny run (tests/support/tiny_run.py) as the YAML config a user would pass."""
    cfg = tiny_run_config(model_dir, root, *overrides)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def _submit(slurm: Cluster, out: Path, port: int, *args: str) -> str:
    """sbatch the template on one node with both CPUs for its Ray (--cpus-per-task is the
    head's --num-cpus); `args`: the config file and overrides. The job id."""
    return slurm.sbatch(
        "--nodes=1",
        "--gpus-per-node=0",  # the template asks for 8; this cluster has none
        "--cpus-per-task=2",
        f"--output={out}",
        str(TEMPLATE),
        *args,
        env={"LOOPRL_NET_IFACE": "lo", "LOOPRL_RAY_PORT": str(port)},
        cwd=REPO,
    )


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _wait_until(slurm: Cluster, job: str, ready, what: str, timeout_s: float = 180) -> None:
    """Wait until `ready()`, failing if JOB ends first or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        state = slurm.job(job)["JobState"]
        assert state in {"PENDING", "CONFIGURING", "RUNNING"}, f"job {job} {state} before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:g} s"
        time.sleep(0.1)


def _ended(slurm: Cluster, job: str, out: Path, state: str, *exit_codes: str) -> str:
    """Wait for JOB to end; check its state and exit code (one of `exit_codes`; any when
    none is given), and that none of its processes (the batch script, looprl train,
    Ray's) outlived it. Its output."""
    info = slurm.wait(job, JOB_TIMEOUT_S)
    text = _text(out)
    print(f"job {job}: {info['JobState']}, exit code {info['ExitCode']}")
    assert info["JobState"] == state, (info, text[-4000:])
    assert not exit_codes or info["ExitCode"] in exit_codes, (info, text[-4000:])
    assert not (left := slurm.left_running(job)), f"left running by job {job}: {left}"
    return text


def test_the_template_starts_ray_and_trains_two_steps_on_it(slurm, tiny_model_dir, tmp_path):
    port = free_port()
    out = tmp_path / "job.out"
    config = _config_file(tiny_model_dir, tmp_path)
    job = _submit(slurm, out, port, str(config), "run.trial_name=sbatch")
    text = _ended(slurm, job, out, "COMPLETED", "0:0")

    address = f"127.0.0.1:{port}"
    assert f"looprl: Ray head on {slurm.host} at {address}, 1 node(s): {slurm.host}" in text
    assert f"looprl: Ray cluster at {address}: 1 nodes, 0 GPUs" in text
    assert f"Joining the Ray cluster at {address}" in text  # looprl train's log
    assert "(2 steps); model saved to" in text
    assert "looprl: stopping Ray on 1 node(s)" in text
    run_dir = tmp_path / "default" / "sbatch"
    assert [r["step"] for r in metrics_records(run_dir, "train")] == [1, 2]
    assert (run_dir / "model" / "model.safetensors").is_file()
    assert "Traceback" not in _text(run_dir / "train.log")


def test_scancel_then_the_same_sbatch_resumes_from_the_last_checkpoint(
    slurm, tiny_model_dir, tmp_path
):
    """One run, three jobs of the same sbatch line. A plain `scancel` signals every
    process of the job at once, the Ray node's step too, whose actors die: the step in
    flight cannot finish, and what the run keeps is step 2's checkpoint (always saved),
    but the script must wait for `looprl train` (a script that exits first leaves it
    outside the job, waiting for its Ray actors forever). The next job resumes from it
    and is stopped by `scancel --batch --signal=TERM`: the script alone gets the SIGTERM
    and passes it on, and `looprl train` saves a checkpoint after the step in flight
    (checkpoint.save_every_steps=0: only the SIGTERM can have saved one after step 2).
    The third job resumes from that and finishes the run."""
    config = _config_file(
        tiny_model_dir, tmp_path, f"train.total_steps={STEPS}", "checkpoint.save_every_steps=0"
    )
    args = (str(config), "run.trial_name=cancelled")
    run_dir = tmp_path / "default" / "cancelled"
    log = run_dir / "train.log"

    def steps() -> list[int]:
        with contextlib.suppress(FileNotFoundError):
            return [r["step"] for r in metrics_records(run_dir, "train")]
        return []

    # 1. scancel JOB
    out = tmp_path / "plain.out"
    job = _submit(slurm, out, free_port(), *args)
    _wait_until(slurm, job, lambda: "checkpoint for step 2 to" in _text(log), "step 2 saved")
    running = " ".join(" ".join(p.cmdline()) for p in slurm.processes(job))
    assert "looprl train" in running and "raylet" in running  # what _ended finds gone
    slurm.run("scancel", job)
    # The exit code is not checked: it is whichever of the job's processes Slurm saw end
    # first, and that races (143:0, 0:9 seen; in one CI run another, its message lost).
    # What is checked: the job ended, nothing outlived it, and the checkpoint is whole.
    text = _ended(slurm, job, out, "CANCELLED")
    assert "looprl: got SIGTERM: sending SIGTERM to looprl train" in text
    saved = checkpoint_io.load_latest(run_dir)
    assert saved is not None and saved.step >= 2 and checkpoint_io.verify(saved.path) is None

    # 2. scancel --batch --signal=TERM JOB, once the resumed run has trained a step
    offset = len(_text(log))
    out = tmp_path / "batch.out"
    job = _submit(slurm, out, free_port(), *args)
    _wait_until(slurm, job, lambda: saved.step + 1 in steps(), f"step {saved.step + 1}")
    slurm.run("scancel", "--batch", "--signal=TERM", job)
    text = _ended(slurm, job, out, "FAILED", "143:0")  # looprl train's, passed on
    assert "looprl: got SIGTERM: sending SIGTERM to looprl train" in text
    assert "looprl: stopping Ray on 1 node(s)" in text
    resumed = _text(log)[offset:]
    assert f"Resumed from {saved.path}: step {saved.step}, " in resumed, resumed[-4000:]
    assert "Received SIGTERM: stopping after this step with a checkpoint" in resumed
    assert "Received SIGTERM again" not in resumed  # it got one
    found = checkpoint_io.load_latest(run_dir)
    assert saved.step < found.step < STEPS and checkpoint_io.verify(found.path) is None
    assert f"Saved recover checkpoint for step {found.step} to" in resumed
    assert steps() == list(range(1, found.step + 1))

    # 3. the same sbatch again: it resumes and finishes; the metrics go on from the saved
    # step, every step once.
    offset = len(_text(log))
    out = tmp_path / "last.out"
    job = _submit(slurm, out, free_port(), *args)
    _ended(slurm, job, out, "COMPLETED", "0:0")
    resumed = _text(log)[offset:]
    assert f"Resumed from {found.path}: step {found.step}, " in resumed, resumed[-4000:]
    assert steps() == list(range(1, STEPS + 1))
    assert (run_dir / "model" / "model.safetensors").is_file()
