import json

import pytest

from looprl.config import TaskConfig
from looprl.tasks import load_task
from looprl.tasks.arithmetic import arithmetic_reward, last_number
from looprl.tasks.math_answer import math_reward


def test_arithmetic_splits_are_seeded_and_disjoint():
    cfg = TaskConfig(digits=1, operators=["+", "*"], train_size=300, eval_size=200)
    task = load_task(cfg)
    assert len(task.eval) == 50  # 200 distinct problems, at most a quarter held out
    assert {r["question"] for r in task.eval}.isdisjoint(r["question"] for r in task.train)
    assert load_task(cfg).train == task.train  # same seed, same problems
    assert load_task(TaskConfig(seed=1)).train != task.train
    row = task.train[0]
    a, op, b = row["question"].removeprefix("What is ").removesuffix("?").split()
    assert row["answer"] == {"+": int(a) + int(b), "*": int(a) * int(b)}[op]


def test_two_digit_problems_are_sampled_with_a_held_out_split():
    task = load_task(TaskConfig(digits=2, operators=["-"], train_size=500, eval_size=100))
    assert len(task.eval) == 100
    assert {r["question"] for r in task.eval}.isdisjoint(r["question"] for r in task.train)
    assert all(10 <= int(r["question"].split()[2]) <= 99 for r in task.train)


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("7 * 8 = 56", 1.0),
        ("The answer is 56.", 1.0),
        ("56, no wait, 54", 0.0),
        ("", 0.0),
        ("It's 1,056", 0.0),
    ],
)
def test_arithmetic_reward_reads_the_last_number(completion, reward):
    assert arithmetic_reward("What is 7 * 8?", completion, answer=56) == reward


def test_last_number_handles_commas_and_signs():
    assert last_number("from -3 to 1,000") == 1000.0
    assert last_number("minus -3") == -3.0
    assert last_number("none") is None


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("3 * 24 = 72\n#### 72", "Natalia sold 48/2 = 24... #### 72", 1.0),
        ("so \\boxed{72}", "72", 1.0),
        ("It costs $1,000 in total.", "#### 1000", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("#### 71", "#### 72", 0.0),
        ("no number", "#### 72", 0.0),
    ],
)
def test_math_reward_uses_math_verify(completion, answer, reward):
    assert math_reward("", completion, answer=answer) == reward


def test_jsonl_dataset_skips_and_counts_bad_rows(tmp_path, caplog):
    path = tmp_path / "train.jsonl"
    rows = [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "4"}]
    path.write_text(
        json.dumps(rows[0])
        + "\n{not json\n"
        + json.dumps({"question": "no answer"})
        + "\n"
        + json.dumps([1, 2])
        + "\n\n"
        + json.dumps(rows[1])
        + "\n"
    )
    task = load_task(TaskConfig(name="jsonl", train_path=str(path)))
    assert task.train == rows
    assert f"{path}:2" in caplog.text and "invalid JSON" in caplog.text
    assert "missing field(s) ['answer']" in caplog.text
    assert "Skipped 3 of 5 rows" in caplog.text
    assert task.reward_fn("", "#### 2", **task.train[0]) == 1.0


def test_parquet_dataset_and_missing_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "3+4?", "a": "7"}]), path)
    task = load_task(
        TaskConfig(name="parquet", train_path=str(path), prompt_field="q", answer_field="a")
    )
    assert task.train == [{"q": "3+4?", "a": "7"}] and task.prompt_field == "q"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_task(TaskConfig(name="jsonl", train_path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(ValueError, match="no usable row"):
        empty = tmp_path / "empty.jsonl"
        empty.write_text("{}\n")
        load_task(TaskConfig(name="jsonl", train_path=str(empty)))
