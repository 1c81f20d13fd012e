"""`looprl sft`: chats -> masked sequences with the real SmolLM2 tokenizer, and a real run
of the command that fine-tunes the tiny model and lowers its held-out loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from looprl.models import load_model, load_tokenizer
from looprl.training.sft_data import ChatError, chat_trajectory, load_chats

ENV = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black"]


@pytest.fixture(scope="module")
def tokenizer(smol_model_dir):
    return load_tokenizer(smol_model_dir)


def _masked_text(tokenizer, trajectory) -> tuple[str, str]:
    ids, mask = trajectory.input_ids, trajectory.loss_mask
    return tokenizer.decode(ids[mask]), tokenizer.decode(ids[~mask])


def test_only_the_assistants_words_and_end_of_turn_are_in_the_loss(tokenizer):
    row = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Sky colour?"},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Grass?"},
            {"role": "assistant", "content": "Green."},
        ]
    }
    trajectory = chat_trajectory(row, tokenizer)
    in_loss, rest = _masked_text(tokenizer, trajectory)
    assert in_loss == "Blue.<|im_end|>Green.<|im_end|>"
    for text in ("Answer briefly.", "Sky colour?", "Grass?", "<|im_start|>assistant\n"):
        assert text in rest
    # the sequence is the chat template's rendering, token for token
    whole = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    assert tokenizer.decode(trajectory.input_ids) == whole
    assert int(trajectory.loss_mask.sum()) == len(
        tokenizer("Blue.<|im_end|>Green.<|im_end|>", add_special_tokens=False).input_ids
    )


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"messages": "hi"}, '"messages" list'),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "no assistant"),
    ],
)
def test_a_bad_chat_names_its_field(tokenizer, row, field):
    with pytest.raises(ChatError, match=field.replace("[", r"\[").replace("]", r"\]")):
        chat_trajectory(row, tokenizer)


def test_bad_lines_are_skipped_named_and_counted(tokenizer, tmp_path):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = tmp_path / "chats.jsonl"
    lines = [json.dumps(good), "{not json", json.dumps({"messages": []}), "", json.dumps(good)]
    path.write_text("\n".join(lines) + "\n")
    chats = load_chats(path, tokenizer, max_tokens=512)
    assert len(chats.trajectories) == 2
    assert [s.split(": ")[0] for s in chats.skipped] == [f"{path}:2", f"{path}:3"]
    with pytest.raises(ValueError, match="no chat to train on"):
        load_chats(path, tokenizer, max_tokens=8)  # every chat is longer than 8 tokens
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="no chat to train on .1 lines skipped"):
        load_chats(tmp_path / "bad.jsonl", tokenizer, 512)
    with pytest.raises(ValueError, match="missing.jsonl does not exist"):
        load_chats(tmp_path / "missing.jsonl", tokenizer, 512)


def _write_chats(path: Path, questions: list[str]) -> None:
    with path.open("w") as f:
        for question in questions:
            messages = [
                {"role": "user", "content": f"What colour is the {question}?"},
                {"role": "assistant", "content": "It is blue, like the sea."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


@pytest.mark.slow
def test_sft_lowers_the_held_out_loss_and_saves_a_model(tiny_model_dir, tmp_path):
    _write_chats(tmp_path / "train.jsonl", [f"{c} box {i}" for c in COLOURS for i in range(3)])
    _write_chats(tmp_path / "eval.jsonl", ["car", "house", "door", "hat"])
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "looprl.cli",
            "sft",
            str(tmp_path / "train.jsonl"),
            f"sft.eval_path={tmp_path / 'eval.jsonl'}",
            f"model.path={tiny_model_dir}",
            f"run.fileroot={tmp_path / 'runs'}",
            "sft.epochs=3",
            "sft.batch_size=8",
            "train.lr=3e-3",
            "train.compute_dtype=float32",
            "eval.every_steps=3",
        ],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "default" / "trial0"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 10))  # 24 chats / 8, 3 epochs
    assert [r["step"] for r in evals] == [0, 3, 6, 9]
    before, after = evals[0]["nll"], evals[-1]["nll"]
    print("held-out nll per step:", [round(r["nll"], 3) for r in evals])
    assert after < 0.5 * before, (before, after)
    assert train[-1]["nll"] < 0.5 * train[0]["nll"]
    assert f"held-out loss per token: {before:.3f} -> {after:.3f}" in done.stdout
    # the output folder is a model looprl train (model.path=) loads
    model = load_model(run_dir / "model")
    assert model.config.num_hidden_layers == load_model(tiny_model_dir).config.num_hidden_layers


def test_sft_refuses_what_it_does_not_do(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "looprl.cli", "sft", "train.kl_coef=0.1", "sft.data_path=x.jsonl"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "train.kl_coef=0.1 is RL's" in done.stderr


@pytest.mark.parametrize("order", ["chats first", "config first"])
def test_the_chats_and_the_config_may_come_in_either_order(tmp_path, order):
    (tmp_path / "warm.yaml").write_text("run:\n  experiment_name: warm\n")
    files = ["chats.jsonl", "warm.yaml"] if order == "chats first" else ["warm.yaml", "chats.jsonl"]
    done = subprocess.run(
        [sys.executable, "-m", "looprl.cli", "sft", *files, "train.lr=1e-4", "--dry-run"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)
    assert resolved["sft"]["data_path"] == "chats.jsonl"
    assert resolved["run"]["experiment_name"] == "warm"
    assert resolved["train"]["lr"] == 1e-4
