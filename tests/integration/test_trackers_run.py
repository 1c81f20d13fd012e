"""A real two-step training run on the tiny model logging to TensorBoard and MLflow: each
holds metrics.jsonl's numbers at its steps, the policy version, the resolved config and
rollout samples decoded by the run's tokenizer."""

from __future__ import annotations

import json

import pytest

from looprl.loop import train
from tests.support.toy_job import EVEN_TOKEN_AGENT


async def test_a_training_run_reaches_tensorboard_and_mlflow(tiny_model_dir, tiny_run, monkeypatch):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = tiny_run(
        f"workflow.path={EVEN_TOKEN_AGENT}",
        "eval.size=2",
        "metrics.backends=[jsonl,tensorboard,mlflow]",
        "metrics.samples_per_step=3",
    )
    await train(cfg, show_progress=False)

    # Every number of metrics.jsonl, under the name trackers get it (nested dicts aside).
    expected: dict[str, list] = {}
    for r in map(json.loads, (cfg.run_dir / "metrics.jsonl").open()):
        for key, value in r.items():
            if key not in ("kind", "step", "time", "version") and type(value) in (int, float):
                point = (r["step"], pytest.approx(value, rel=1e-6))  # TensorBoard: float32
                expected.setdefault(f"{r['kind']}/{key}", []).append(point)
    assert {"train/loss", "train/reward_mean", "eval/accuracy"} <= set(expected)
    assert [step for step, _ in expected["train/loss"]] == [1, 2]
    assert [step for step, _ in expected["eval/accuracy"]] == [0, 2]

    events = EventAccumulator(str(cfg.run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    for name, values in expected.items():
        assert [(e.step, e.value) for e in events.Scalars(name)] == values, name
    versions = sorted({(e.step, e.value) for e in events.Scalars("policy_version")})
    assert versions == [(0, 0.0), (1, 1.0), (2, 2.0)]
    [config] = events.Tensors("config/text_summary")
    assert f"    model.path: {json.dumps(str(tiny_model_dir))}\n" in (
        config.tensor_proto.string_val[0].decode()
    )
    samples = events.Tensors("samples/text_summary")
    assert [e.step for e in samples] == [1, 2]
    text = samples[0].tensor_proto.string_val[0].decode()
    assert text.count("#### reward ") == 3 and text.count("<|im_start|>user") == 3

    client = MlflowClient(tracking_uri=f"sqlite:///{cfg.run_dir / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("looprl").experiment_id])
    for name, values in expected.items():
        history = client.get_metric_history(run.info.run_id, name)
        assert [(m.step, m.value) for m in history] == values, name
    assert run.data.params["model.path"] == str(tiny_model_dir)
    assert run.data.params["rollout.group_size"] == "2"
    assert (
        len(list((cfg.run_dir / "mlruns" / run.info.run_id / "artifacts" / "samples").iterdir()))
        == 2
    )
