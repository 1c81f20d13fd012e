"""Experiment trackers (looprl/trackers/) and Metrics sending records to them.

Each backend is read back with its own reader (TensorBoard's EventAccumulator, the W&B
transaction log, MlflowClient, Trackio's SQLite database) and must hold exactly the
numbers metrics.jsonl holds, at the same steps.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from looprl.config import ConfigError, load_config
from looprl.runs.metrics import Metrics, sample_rows
from looprl.trackers import flatten, start_trackers
from looprl.types import Trajectory

# What the job below logs, as each tracker must hold it: (step, value) per name. NaN
# (reward_mean at step 2) and non-numbers are left out; `version` is `policy_version`,
# and an evaluation carries the version of the last train step.
EXPECTED = {
    "eval/accuracy": [(0, 0.5), (2, 0.75)],
    "train/loss": [(1, 1.0), (2, 0.5)],
    "train/reward_mean": [(1, 0.25)],
    "train/errors/TimeoutError": [(1, 3.0)],
    "policy_version": [(0, 0.0), (1, 1.0), (2, 2.0)],
}
# Two samples per step (samples_per_step=2) of three trajectories, decoded as "t<id>".
SAMPLES = [
    {
        "prompt": "t10 t11",
        "completion": "t12 t13",
        "reward": 1.0,
        "advantage": 0.5,
        "group_id": "g0",
    },
    {
        "prompt": "t10 t11",
        "completion": "t12 t13",
        "reward": 0.0,
        "advantage": -0.5,
        "group_id": "g0",
    },
]


def trajectory(reward: float, group_id: str = "g0", prompt_tokens: int = 2) -> Trajectory:
    ids = torch.tensor([10, 11, 12, 13])
    return Trajectory(
        input_ids=ids,
        loss_mask=torch.arange(4) >= prompt_tokens,
        behavior_logprobs=torch.zeros(4),
        versions=torch.where(torch.arange(4) >= prompt_tokens, 0, -1),
        reward=reward,
        group_id=group_id,
    )


def decode(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def log_the_job(metrics: Metrics) -> None:
    """The records EXPECTED describes, and SAMPLES at steps 1 and 2."""
    batch = [trajectory(1.0), trajectory(0.0), trajectory(0.5, "g1")]
    advantages = torch.tensor([0.5, -0.5, 0.0])
    metrics.log("eval", 0, {"accuracy": 0.5, "errors": {}})
    metrics.log(
        "train",
        1,
        {"loss": 1.0, "version": 1.0, "reward_mean": 0.25, "errors": {"TimeoutError": 3}},
    )
    metrics.log_samples(1, batch, advantages, decode)
    metrics.log("train", 2, {"loss": 0.5, "version": 2.0, "reward_mean": float("nan")})
    metrics.log_samples(2, batch, advantages, decode)
    metrics.log("eval", 2, {"accuracy": 0.75, "status": "ok"})


JOB = """
import sys
from pathlib import Path
from looprl.config import load_config
from looprl.runs.metrics import Metrics
from looprl.trackers import start_trackers
from tests.unit.test_trackers import log_the_job

cfg = load_config(None, [f"run.fileroot={sys.argv[1]}", f"metrics.backends={sys.argv[2]}",
                         "train.lr=0.125", "metrics.samples_per_step=2"])
trackers = start_trackers(cfg, cfg.run_dir)
with Metrics(cfg.run_dir, 2, show_progress=False, trackers=trackers, samples_per_step=2) as m:
    log_the_job(m)
"""


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> Path:
    """The run dir of the job logged to every backend, in a process of its own (W&B and
    Trackio keep a current run per process; Trackio reads TRACKIO_DIR on import)."""
    root = tmp_path_factory.mktemp("trackers")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(TRACKIO_DIR=str(root / "trackio"), WANDB_SILENT="true")
    done = subprocess.run(
        [sys.executable, "-c", JOB, str(root), "[jsonl,tensorboard,wandb,mlflow,trackio]"],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "default" / "trial0"


def from_jsonl(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl's numbers under the names trackers get, for comparison."""
    found: dict[str, list[tuple[int, float]]] = {}
    for line in (run_dir / "metrics.jsonl").open():
        record = json.loads(line)
        for key in ("loss", "reward_mean", "accuracy"):
            if record.get(key) is not None:
                found.setdefault(f"{record['kind']}/{key}", []).append(
                    (record["step"], record[key])
                )
    return found


def points(pairs) -> list[tuple[int, float]]:
    """(step, value) pairs sorted, each once (an evaluation repeats the step's version)."""
    return sorted({(int(s), float(v)) for s, v in pairs})


# ---- Metrics -> trackers --------------------------------------------------------------


class Recording:
    """A tracker that keeps what it is sent; `fail_on` raises on that call of log."""

    name = "recording"

    def __init__(self, fail_on: int | None = None):
        self.logged: list[tuple[int, dict]] = []
        self.samples: list[tuple[int, list[dict]]] = []
        self.finished = False
        self.fail_on = fail_on

    def log_config(self, config):
        raise AssertionError("start_trackers logs the config, not Metrics")

    def log(self, step, values):
        if len(self.logged) + 1 == self.fail_on:
            raise OSError(28, "No space left on device")
        self.logged.append((step, values))

    def log_samples(self, step, rows):
        self.samples.append((step, rows))

    def finish(self):
        self.finished = True


def test_records_reach_trackers_as_named_scalars_with_the_policy_version(tmp_path):
    tracker = Recording()
    with Metrics(tmp_path, 2, show_progress=False, trackers=[tracker], samples_per_step=2) as m:
        log_the_job(m)
    assert tracker.logged == [
        (0, {"eval/accuracy": 0.5, "policy_version": 0.0}),
        (
            1,
            {
                "train/loss": 1.0,
                "train/reward_mean": 0.25,
                "train/errors/TimeoutError": 3.0,
                "policy_version": 1.0,
            },
        ),
        (2, {"train/loss": 0.5, "policy_version": 2.0}),
        (2, {"eval/accuracy": 0.75, "policy_version": 2.0}),
    ]
    assert tracker.samples == [(1, SAMPLES), (2, SAMPLES)]
    assert tracker.finished


def test_sample_rows_split_prompt_and_completion_at_the_first_sampled_token():
    rows = sample_rows(
        [trajectory(1.0, "a", prompt_tokens=1), trajectory(0.0, "b", prompt_tokens=3)],
        torch.tensor([0.25, -0.25]),
        decode,
    )
    assert rows == [
        {
            "prompt": "t10",
            "completion": "t11 t12 t13",
            "reward": 1.0,
            "advantage": 0.25,
            "group_id": "a",
        },
        {
            "prompt": "t10 t11 t12",
            "completion": "t13",
            "reward": 0.0,
            "advantage": -0.25,
            "group_id": "b",
        },
    ]


def test_no_samples_are_decoded_when_samples_per_step_is_0(tmp_path):
    tracker = Recording()
    with Metrics(tmp_path, 1, show_progress=False, trackers=[tracker], samples_per_step=0) as m:
        m.log_samples(1, [trajectory(1.0)], torch.tensor([0.0]), decode)
    assert tracker.samples == []


def test_a_failing_tracker_is_logged_once_turned_off_and_the_jsonl_stays_complete(tmp_path, caplog):
    failing, healthy = Recording(fail_on=2), Recording()
    with (
        caplog.at_level(logging.ERROR, logger="looprl.runs.metrics"),
        Metrics(tmp_path, 2, show_progress=False, trackers=[failing, healthy]) as m,
    ):
        log_the_job(m)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "The recording tracker failed and is turned off" in errors[0].getMessage()
    assert "No space left on device" in errors[0].exc_text
    assert len(failing.logged) == 1 and not failing.finished  # nothing sent after the error
    assert len(healthy.logged) == 4 and healthy.finished
    assert m.trackers == [healthy]
    steps = [(r["kind"], r["step"]) for r in map(json.loads, (tmp_path / "metrics.jsonl").open())]
    assert steps == [("eval", 0), ("train", 1), ("train", 2), ("eval", 2)]


def test_a_resume_sends_no_old_record_and_keeps_the_policy_version(tmp_path):
    with Metrics(tmp_path, 3, show_progress=False) as m:
        log_the_job(m)
        state = m.state_dict()
    tracker = Recording()
    with Metrics(tmp_path, 3, show_progress=False, resume=True, trackers=[tracker]) as m:
        m.load_state_dict(state)
        assert tracker.logged == []
        m.log("eval", 2, {"accuracy": 1.0})
    assert tracker.logged == [(2, {"eval/accuracy": 1.0, "policy_version": 2.0})]


def test_flatten_joins_nested_keys_and_keeps_lists():
    tree = {"a": {"b": 1, "c": {"d": None}}, "e": [2, 3], "f": {}}
    assert flatten(tree) == {"a.b": 1, "a.c.d": None, "e": [2, 3], "f": {}}
    assert flatten({"train": {"errors": {"X": 1}}}, sep="/") == {"train/errors/X": 1}


# ---- choosing backends --------------------------------------------------------------


def test_an_unknown_backend_is_rejected_naming_the_field():
    with pytest.raises(ConfigError, match=r"metrics\.backends\.1='neptune'"):
        load_config(None, ["metrics.backends=[jsonl,neptune]"])


@pytest.mark.parametrize(
    ("backend", "module"),
    [
        ("tensorboard", "tensorboard"),
        ("wandb", "wandb"),
        ("mlflow", "sqlalchemy"),
        ("trackio", "trackio"),
    ],
)
def test_a_missing_package_names_the_extra(backend, module, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, module, None)  # import fails, as if not installed
    cfg = load_config(None, [f"run.fileroot={tmp_path}", f"metrics.backends=[jsonl,{backend}]"])
    with pytest.raises(ConfigError) as error:
        start_trackers(cfg, cfg.run_dir)
    assert str(error.value) == (
        f"metrics.backends has {backend!r} but {module} is not installed: "
        f"pip install 'looprl[{backend}]', or remove {backend} from metrics.backends"
    )
    assert not (cfg.run_dir / "tensorboard").exists()  # nothing started


def test_jsonl_alone_starts_no_tracker(tmp_path):
    cfg = load_config(None, [f"run.fileroot={tmp_path}"])
    assert cfg.metrics.backends == ["jsonl"]
    assert start_trackers(cfg, cfg.run_dir) == []


# ---- each backend, read back --------------------------------------------------------


def test_tensorboard_holds_the_jsonl_values_the_config_and_the_samples(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logged / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    scalars = {tag: points((e.step, e.value) for e in events.Scalars(tag)) for tag in EXPECTED}
    assert scalars == EXPECTED
    assert sorted(events.Tags()["scalars"]) == sorted(EXPECTED)
    for name, values in from_jsonl(logged).items():
        assert scalars[name] == values, name

    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "    train.lr: 0.125\n" in config
    assert '    metrics.backends: ["jsonl", "tensorboard", "wandb", "mlflow", "trackio"]' in config
    hparams = events.SummaryMetadata("_hparams_/session_start_info").plugin_data.content
    assert b"train.lr" in hparams and struct.pack("<d", 0.125) in hparams

    samples = events.Tensors("samples/text_summary")
    assert [e.step for e in samples] == [1, 2]
    text = samples[0].tensor_proto.string_val[0].decode()
    assert text == (
        "#### reward 1, advantage 0.5, group_id g0\n\n**prompt**\n\n    t10 t11\n\n"
        "**completion**\n\n    t12 t13\n\n"
        "#### reward 0, advantage -0.5, group_id g0\n\n**prompt**\n\n    t10 t11\n\n"
        "**completion**\n\n    t12 t13"
    )


def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (`run-*.wandb`): a 7-byte header, then
    LevelDB-log framing in 32 KiB blocks (per chunk: CRC32, length, type; FULL=1,
    FIRST=2, MIDDLE=3, LAST=4), each record a protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    block, pos, chunks, records = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the rest of the block is padding
            pos += left
            continue
        chunks += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def test_wandb_offline_run_holds_the_jsonl_values_the_config_and_the_samples(logged):
    [run] = (logged / "wandb").glob("offline-run-*")
    records = wandb_records(next(run.glob("run-*.wandb")))
    history: dict[str, list] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in r.history.item
            }
            for key, value in row.items():
                history.setdefault(key, []).append((row["_step"], value))
    assert {name: points(history[name]) for name in EXPECTED} == EXPECTED
    for name, values in from_jsonl(logged).items():
        assert points(history[name]) == values, name

    config = {}
    for r in records:
        if r.WhichOneof("record_type") == "config":
            config.update({item.key: json.loads(item.value_json) for item in r.config.update})
    assert config["train.lr"] == 0.125 and config["run.trial_name"] == "trial0"

    assert [step for step, _ in history["samples/path"]] == [1, 2]
    table = json.loads((run / "files" / history["samples/path"][0][1]).read_text())
    assert table["columns"] == list(SAMPLES[0])
    assert table["data"] == [list(row.values()) for row in SAMPLES]


def test_mlflow_local_run_holds_the_jsonl_values_the_params_and_the_samples(logged):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{logged / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("looprl").experiment_id])
    assert run.info.run_name == "default-trial0" and run.info.status == "FINISHED"
    history = {
        name: points((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        for name in run.data.metrics
    }
    assert history == EXPECTED
    for name, values in from_jsonl(logged).items():
        assert history[name] == values, name
    params = run.data.params
    assert params["train.lr"] == "0.125"
    assert params["metrics.backends"] == "['jsonl', 'tensorboard', 'wandb', 'mlflow', 'trackio']"
    assert len(params) == len(flatten(load_config(None, []).model_dump(mode="json")))

    artifacts = logged / "mlruns" / run.info.run_id / "artifacts" / "samples"
    assert sorted(p.name for p in artifacts.iterdir()) == ["step_000001.json", "step_000002.json"]
    assert json.loads((artifacts / "step_000001.json").read_text()) == SAMPLES


def test_trackio_local_run_holds_the_jsonl_values_the_config_and_the_samples(logged):
    db = sqlite3.connect(logged.parents[1] / "trackio" / "looprl.db")
    rows = db.execute("SELECT step, metrics FROM metrics WHERE run_name = ?", ("default-trial0",))
    history: dict[str, list] = {}
    for step, blob in rows:
        for key, value in json.loads(blob).items():
            history.setdefault(key, []).append((step, value))
    assert {name: points(history[name]) for name in EXPECTED} == EXPECTED
    assert set(history) == {*EXPECTED, "samples"}
    for name, values in from_jsonl(logged).items():
        assert points(history[name]) == values, name

    assert [step for step, _ in history["samples"]] == [1, 2]
    table = history["samples"][0][1]
    assert table["_type"] == "trackio.table" and table["_value"] == SAMPLES

    [(config,)] = db.execute("SELECT config FROM configs WHERE run_name = ?", ("default-trial0",))
    config = json.loads(config)
    assert config["train.lr"] == 0.125 and config["run.trial_name"] == "trial0"


def test_the_plot_shows_the_mismatch_under_the_reward():
    import matplotlib

    matplotlib.use("Agg")
    from looprl.runs.metrics import figure

    records = [
        {"kind": "eval", "step": 0, "accuracy": 0.25},
        {"kind": "train", "step": 1, "reward_mean": 0.5, "mismatch_logprob_abs_mean": 0.01,
         "mismatch_kl_k3": 0.002},
        {"kind": "train", "step": 2, "reward_mean": 0.75, "mismatch_logprob_abs_mean": 0.03,
         "mismatch_kl_k3": None},
    ]  # fmt: skip
    fig = figure(records)
    top, below = fig.axes
    assert [list(line.get_ydata()) for line in top.lines] == [[0.5, 0.75], [0.25]]
    lines = {line.get_label(): list(line.get_ydata()) for line in below.lines}
    assert lines == {
        "mean |log pi_trainer - log pi_engine|": [0.01, 0.03],
        "KL(engine || trainer), k3": [0.002],  # a missing value is left out, not drawn as 0
    }
