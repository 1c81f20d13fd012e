"""task.name=reasoning_gym: real reasoning-gym datasets, their own verifiers, the
held-out split by seed, the answer formats, config errors, and a one-step run."""

from __future__ import annotations

import pytest

from looprl.config import ConfigError, TaskConfig, load_config
from looprl.tasks import load_task
from looprl.tasks.reasoning_gym import extract_answer
from tests.support.tiny_run import train_and_read


def rg_task(**options):
    return load_task(TaskConfig(name="reasoning_gym", train_size=50, eval_size=20, **options))


def test_splits_are_seeded_and_disjoint():
    task = rg_task(dataset="leg_counting", dataset_kwargs={"max_animals": 3})
    assert len(task.eval) == 20 and 0 < len(task.train) <= 50
    assert not {r["question"] for r in task.train} & {r["question"] for r in task.eval}
    again = rg_task(dataset="leg_counting", dataset_kwargs={"max_animals": 3})
    assert again.train == task.train and again.eval == task.eval  # same seed, same problems
    other = rg_task(dataset="leg_counting", dataset_kwargs={"max_animals": 3}, seed=5)
    assert other.train != task.train


@pytest.mark.parametrize(
    ("answer_format", "template"),
    [
        ("last_number", "Adding them up gives {answer}."),
        ("last_line", "Let me add.\n{answer}\n"),
        ("tags", "Thinking <answer>7</answer> no wait <answer>{answer}</answer>"),
    ],
)
def test_the_verifier_scores_the_extracted_answer(answer_format, template):
    task = rg_task(dataset="basic_arithmetic", answer_format=answer_format)
    for row in task.train[:5] + task.eval[:5]:
        right = template.format(answer=row["answer"])
        assert task.reward_fn(row["question"], right, **row) == 1.0
        wrong = template.format(answer=f"{row['answer']}1")
        assert task.reward_fn(row["question"], wrong, **row) < 1.0
    row = task.train[0]
    assert task.reward_fn(row["question"], "I do not know.", **row) == 0.0


def test_answer_formats():
    assert extract_answer("no tags here 5", "tags") is None
    assert extract_answer("", "last_line") is None
    assert extract_answer("1,234 legs", "last_number") == "1234"


def test_unknown_dataset_and_bad_kwargs_name_the_field():
    with pytest.raises(ConfigError, match=r"task.dataset='no_such_game' is not a reasoning-gym"):
        rg_task(dataset="no_such_game")
    with pytest.raises(ConfigError, match=r"task.dataset_kwargs=\{'bogus': 1\}"):
        rg_task(dataset="leg_counting", dataset_kwargs={"bogus": 1})
    with pytest.raises(ConfigError, match="needs task.dataset"):
        load_config(None, ["task.name=reasoning_gym"])
    with pytest.raises(ConfigError, match="task.dataset='leg_counting'"):
        load_config(None, ["task.dataset=leg_counting"])  # without task.name=reasoning_gym


async def test_a_reasoning_gym_run(tiny_run):
    cfg = tiny_run(
        "task.name=reasoning_gym",
        "task.dataset=leg_counting",
        "task.dataset_kwargs={min_animals: 1, max_animals: 2}",
        "task.train_size=20",
        "task.eval_size=2",
        "train.total_steps=1",
        "sampling.max_new_tokens=8",
        "eval.max_new_tokens=8",
    )
    _, [step], _ = await train_and_read(cfg)
    assert step["completed"] == 4 and step["failed"] == 0
