"""Trajectory files written by a real training run, read back and shown by `looprl show`.

A two-call agent trains the tiny model for two steps through the real loop, gateway,
engine and trainer; the files must hold exactly what was trained (each row its own
batch row and advantage), the messages the agent sent, and the trainer's logprobs. The
tool model checks that a call's parsed tool calls reach the record.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from openai import AsyncOpenAI

from examples.calculator.tools import TOOLS
from looprl import loop
from looprl.commands.show import visible
from looprl.config import SamplingConfig
from looprl.models import load_model, load_tokenizer
from looprl.runs.trajectories import list_steps, read_step
from tests.support.local_gateway import local_gateway

SYSTEM = {"role": "system", "content": "Answer in one word."}
AGAIN = {"role": "user", "content": "Say it again."}
SENT: list[list[dict]] = []  # every request's messages, as TwoCallAgent sent them


class TwoCallAgent:
    """Asks the question, then asks again with the reply in the history; rewarded by the
    share of even token ids sampled (so a group's rewards differ)."""

    async def run(self, data, *, base_url, api_key, model, **kw):
        messages = [SYSTEM, {"role": "user", "content": data["question"]}]
        ids: list[int] = []
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            for _ in range(2):
                SENT.append([dict(m) for m in messages])
                response = await client.chat.completions.create(
                    model=model, messages=messages, max_tokens=6
                )
                reply = response.choices[0].message.content
                ids += response.choices[0].token_ids
                messages = [*messages, {"role": "assistant", "content": reply}, AGAIN]
        return sum(i % 2 == 0 for i in ids) / len(ids)


async def test_a_training_run_writes_what_each_step_trained(tiny_run, monkeypatch):
    cfg = tiny_run(
        "workflow.path=tests.integration.test_trajectory_files:TwoCallAgent",
        "train.ppo_epochs=2",  # the trainer computes proximal logprobs: they are written
        "rollout.group_size=3",
        "sampling.max_new_tokens=6",
        "eval.size=1",
        "eval.max_new_tokens=2",
    )
    batches = []  # what the loop trained on, step by step
    build_batch = loop.build_batch

    def spy(trajectories, *args, **kwargs):
        batch, stats = build_batch(trajectories, *args, **kwargs)
        batches.append(batch)
        return batch, stats

    monkeypatch.setattr(loop, "build_batch", spy)
    SENT.clear()
    await loop.train(cfg, show_progress=False)

    files = list_steps(cfg.run_dir)
    assert [step for step, _ in files] == [1, 2]
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").open()]
    train = [r for r in records if r["kind"] == "train"]
    for (step, path), batch, record in zip(files, batches, train, strict=True):
        rows = read_step(path)
        assert len(rows) == batch.num_sequences == record["trajectories"] == 6
        assert record["trajectories_pruned"] == 0 and record["trajectories_write_errors"] == 0
        for i, row in enumerate(rows):
            n = len(row["token_ids"])
            assert row["step"] == step and row["policy_version"] == step - 1
            assert row["staleness"] == 0  # synchronous: sampled by the version trained from
            assert row["token_ids"] == batch.input_ids[i, :n].tolist()
            assert row["advantage"] == pytest.approx(float(batch.advantages[i]), abs=1e-6)
            assert row["loss_mask"] == batch.loss_mask[i, :n].tolist()
            assert len(row["loss_mask"]) == len(row["token_text"]) == len(row["token_versions"])
            assert row["token_versions"] == batch.versions[i, :n].tolist()
            sampled = [k for k, m in enumerate(row["loss_mask"]) if m]
            gaps = [abs(row["trainer_logprobs"][k] - row["engine_logprobs"][k]) for k in sampled]
            assert max(gaps) < 1e-3, gaps  # float32 engine and trainer, the same weights
            # The calls hold what the agent sent, the second the first's reply in history.
            first, second = row["calls"]
            assert first["messages"] in SENT and second["messages"] in SENT
            assert first["messages"][0] == SYSTEM
            assert second["messages"][2:] == [
                {"role": "assistant", "content": first["reply"]},
                AGAIN,
            ]
            assert first["started_s"] <= first["ended_s"] <= second["started_s"]
            assert first["reward"] == second["reward"] == row["reward"]  # broadcast
            # A reply leaves out the special tokens the sequence's decoding keeps (the tiny
            # random model samples e.g. <jupyter_script>)
            text = re.sub(r"<[^<>\s]+>", "", row["text"])
            assert first["reply"] in text and second["reply"] in text
            assert row["concat_breaks"] == [] and row["error"] is None
            assert row["timings"]["rollout_s"] > 0
        groups = [r["group_id"] for r in rows]
        assert sorted(r["sample_index"] for r in rows) == [0, 0, 1, 1, 2, 2]
        assert len(set(groups)) == 2 and all(groups.count(g) == 3 for g in groups)

    # `looprl show`, as a user runs it: the latest step's first row.
    done = subprocess.run(
        [sys.executable, "-m", "looprl.cli", "show", str(cfg.run_dir)],
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "PYTHONIOENCODING": "utf-8"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    row = read_step(files[-1][1])[0]
    assert "step_000002.parquet: row 0 of 6" in done.stdout
    assert f"group {row['group_id']}" in done.stdout
    assert "user: Say it again." in done.stdout
    squeezed = "".join(done.stdout.split())
    for call in row["calls"]:  # as shown: a random model's control characters escaped
        assert "".join(visible(call["reply"]).split()) in squeezed


@pytest.mark.parametrize("stream", [False, True])
async def test_the_gateway_records_each_calls_messages_and_tool_calls(tool_model_dir, stream):
    gateway = local_gateway(
        load_model(tool_model_dir),
        load_tokenizer(tool_model_dir),
        model_name="calc",
        default_sampling=SamplingConfig(temperature=0, max_new_tokens=40),
    )
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    async with gateway as server:
        handle = server.open_session()
        async with AsyncOpenAI(
            base_url=handle.base_url, api_key=handle.api_key, max_retries=0
        ) as client:
            response = await client.chat.completions.create(
                model="calc", messages=question, tools=TOOLS, stream=stream
            )
            if stream:
                async for _ in response:
                    pass
        (it,) = server.close_session(handle.id).interactions
    assert it.messages == question
    (tool_call,) = it.tool_calls
    assert tool_call["function"]["name"] == "add"
    assert json.loads(tool_call["function"]["arguments"]) == {"a": 2, "b": 3}
    assert "index" not in tool_call  # as the agent gets it in a message, not a delta
    assert it.started_s <= it.ended_s
