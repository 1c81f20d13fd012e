"""The configuration reference (config/reference.py): every field of Config with its
dotted name, type, default and description, read from the schema."""

import re

import pytest
from pydantic import BaseModel

from looprl.config.reference import Row, markdown, sections, type_name
from looprl.config.schema import Config


def leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    names = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names += leaves(annotation, prefix + name + ".")
        else:
            names.append(prefix + name)
    return names


def rows() -> dict[str, Row]:
    return {row.name: row for section in sections() for row in section.rows}


def cells(page: str, name: str) -> list[str]:
    """The cells of the table row of `name` on the page, as Markdown."""
    (line,) = [line for line in page.splitlines() if line.startswith(f"| `{name}` |")]
    pipe = r"(?<!\\)\|(?=(?:[^`]*`[^`]*`)*[^`]*$)"  # not escaped, not inside a code span
    return [cell.strip() for cell in re.split(pipe, line)[1:-1]]


def test_every_leaf_field_has_a_row_with_its_dotted_name():
    page = markdown()
    names = leaves(Config)
    assert len(names) > 150 and "train.overlong.max_tokens" in names
    missing = [name for name in names if f"| `{name}` |" not in page]
    assert not missing, missing


def test_one_heading_per_section_nested_ones_included():
    page = markdown()
    headings = re.findall(r"^## (\S+)$", page, re.MULTILINE)
    assert headings[:3] == ["model", "model.lora", "engine"]
    assert {"gateway.limits", "reward.code", "reward.judge", "train.overlong", "run"} <= set(
        headings
    )
    assert len(headings) == len(set(headings)) == len(sections())


def test_hand_picked_rows_are_what_the_source_says():
    by_name = rows()
    assert by_name["run.seed"] == Row(
        "run.seed", "int", "", "0", "Seed for torch, sampling and data order."
    )
    backends = by_name["metrics.backends"]
    assert backends.type == "list['jsonl' | 'tensorboard' | 'wandb' | 'mlflow' | 'trackio']"
    assert backends.default == "['jsonl']"  # its default_factory, called
    assert backends.description.startswith("Where metrics go: metrics.jsonl always, plus")
    assert by_name["model.lora.rank"] == Row(
        "model.lora.rank",
        "int",
        ">= 0, <= 1024",
        "0",
        "Adapter rank r; 0 (default) trains every weight.",
    )
    assert by_name["train.lr"] == Row(
        "train.lr", "float", "> 0", "2e-05", "Peak AdamW learning rate."
    )
    assert by_name["engine.memory_fraction"].type == "float | None"
    assert by_name["engine.memory_fraction"].bounds == "> 0, < 1"
    assert by_name["engine.memory_fraction"].default == "None"
    assert by_name["model.lora.target_modules"].type == "list[str] | 'all-linear'"
    assert by_name["engine.dtype"].type == "'auto' | 'float32' | 'bfloat16'"
    assert by_name["engine.server_args"].default == "[]"
    assert by_name["task.dataset_kwargs"].type == "dict[str, Any]"
    assert by_name["task.dataset_kwargs"].default == "{}"


def test_rows_as_the_page_shows_them():
    page = markdown()
    assert cells(page, "run.seed") == [
        "`run.seed`",
        "`int`",
        "`0`",
        "Seed for torch, sampling and data order.",
    ]
    assert cells(page, "metrics.backends")[1:3] == [
        "`list['jsonl' | 'tensorboard' | 'wandb' | 'mlflow' | 'trackio']`",
        "`['jsonl']`",
    ]
    assert cells(page, "model.lora.rank")[1] == "`int`, >= 0, &lt;= 1024"
    # A nested section points to its own table instead of dumping its defaults.
    assert cells(page, "model.lora")[1:3] == ["section", "see [model.lora](#modellora)"]
    assert "{'rank'" not in page


def test_text_that_markdown_would_read_is_escaped():
    page = markdown()
    # engine.url's description names <run_dir>, which HTML would swallow as a tag.
    assert "&lt;run\\_dir>/weights" in cells(page, "engine.url")[3]
    # A judge prompt's default holds newlines: it stays on its row, as Python's repr.
    assert cells(page, "reward.judge.prompt")[2].startswith('`"Rate the answer')


def test_every_row_renders_as_four_cells():
    markdown_lib = pytest.importorskip("markdown")
    html = markdown_lib.markdown(markdown(), extensions=["tables"])
    for row in re.findall(r"<tr>(.*?)</tr>", html, re.DOTALL):
        assert len(re.findall(r"<t[dh]>", row)) == 4, row


def test_type_names():
    assert type_name(int) == "int"
    assert type_name(int | None) == "int | None"
    assert type_name(list[str]) == "list[str]"
