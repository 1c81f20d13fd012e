"""The run's plot (`looprl.runs.metrics.figure`) with and without the multi-turn keys:
the panels it draws, and the values read back from its lines and stacked areas."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest

from looprl.runs.metrics import MAX_ACTION_WORDS, figure

TURNS_PER_STEP = {1: 2, 2: 3, 3: 2}  # step 2 has a third turn position
ACTIONS = {  # step -> first word -> share; "click" is missing at step 2, "answer" at 1
    1: {"search": 0.5, "click": 0.3, "other": 0.2},
    2: {"search": 0.6, "answer": 0.3, "other": 0.1},
    3: {"search": 0.4, "click": 0.2, "answer": 0.3, "other": 0.1},
}


def single_turn_records() -> list[dict]:
    records: list[dict] = [{"kind": "eval", "step": 0, "accuracy": 0.2}]
    for step in (1, 2, 3):
        records.append(
            {
                "kind": "train",
                "step": step,
                "reward_mean": 0.1 * step,
                "entropy": 2.0 - 0.1 * step,
                "mismatch_logprob_abs_mean": 1e-3,
                "mismatch_kl_k3": 2e-4,
            }
        )
    return records


def multi_turn_records() -> list[dict]:
    records = single_turn_records()
    for record in records[1:]:
        step = record["step"]
        turns = TURNS_PER_STEP[step]
        record["degenerate_group_share"] = 0.1 * step
        for k in range(1, turns + 1):
            record[f"turn{k}_samples"] = 16 // k
            record[f"turn{k}_return_mean"] = step + k / 10
            record[f"turn{k}_advantage_mean"] = 0.0
            record[f"turn{k}_advantage_abs_mean"] = step / 10 + k
            record[f"turn{k}_entropy"] = 3.0 - step / 10 - k / 100
            record[f"turn{k}_loss_share"] = 1 / turns
        for word, share in ACTIONS[step].items():
            record[f"action_share_{word}"] = share
        record["action_top_share"] = max(ACTIONS[step].values())
        record["action_entropy"] = 1.0
    return records


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def panel(fig, title_start: str):
    (ax,) = [ax for ax in fig.axes if ax.get_title().startswith(title_start)]
    return ax


def line(ax, label: str) -> tuple[list, list]:
    (found,) = [ln for ln in ax.get_lines() if ln.get_label() == label]
    return list(found.get_xdata()), list(found.get_ydata())


def band(ax, label: str) -> dict[float, tuple[float, float]]:
    """A stacked area's band as {step: (bottom, top)}, read from its polygon."""
    (found,) = [c for c in ax.collections if c.get_label() == label]
    edges: dict[float, list[float]] = {}
    for x, y in found.get_paths()[0].vertices:
        edges.setdefault(float(x), []).append(float(y))
    return {x: (min(ys), max(ys)) for x, ys in edges.items()}


def test_a_single_turn_run_gets_the_two_panels_of_today():
    fig = figure(single_turn_records())
    assert len(fig.axes) == 2
    assert [ax.get_title() for ax in fig.axes] == [
        "",
        "engine vs trainer, tokens of the trainer's version",
    ]


def test_a_multi_turn_run_gets_six_panels_more_and_the_first_two_unchanged():
    records = multi_turn_records()
    fig = figure(records)
    assert len(fig.axes) == 8
    assert line(fig.axes[0], "train reward (mean, sampled)") == ([1, 2, 3], [0.1, 0.2, 0.1 * 3])
    for title in ("mean reward", "mean |advantage|", "token entropy", "signs of collapse"):
        panel(fig, title)
    assert [c.get_label() for c in panel(fig, "share of the loss").collections] == [
        "turn 1",
        "turn 2",
        "turn 3",
    ]


@pytest.mark.parametrize(
    ("title", "name"),
    [
        ("mean reward", "return_mean"),
        ("mean |advantage|", "advantage_abs_mean"),
        ("token entropy", "entropy"),
    ],
)
def test_each_turn_position_is_a_line_of_its_values_at_the_steps_that_have_it(title, name):
    records = multi_turn_records()
    ax = panel(figure(records), title)
    for k in (1, 2, 3):
        logged = [r for r in records if f"turn{k}_{name}" in r]
        assert line(ax, f"turn {k}") == (
            [r["step"] for r in logged],
            [r[f"turn{k}_{name}"] for r in logged],
        )
    assert line(ax, "turn 3")[0] == [2]  # only step 2 had a third turn


def test_entropy_overall_and_the_collapse_signals_are_drawn():
    records = multi_turn_records()[1:]
    fig = figure(multi_turn_records())
    assert line(panel(fig, "token entropy"), "all turns")[1] == [r["entropy"] for r in records]
    collapse = panel(fig, "signs of collapse")
    assert line(collapse, "groups with equal returns") == (
        [1, 2, 3],
        [r["degenerate_group_share"] for r in records],
    )
    assert line(collapse, "most common first word")[1] == [0.5, 0.6, 0.4]


def test_a_turn_position_has_one_color_in_every_panel():
    fig = figure(multi_turn_records())
    for k in (1, 2, 3):
        colors = {
            _line_color(panel(fig, title), f"turn {k}")
            for title in ("mean reward", "mean |advantage|", "token entropy")
        }
        (loss,) = [
            c for c in panel(fig, "share of the loss").collections if c.get_label() == f"turn {k}"
        ]
        colors.add(matplotlib.colors.to_hex(loss.get_facecolor()[0]))
        assert len(colors) == 1, (k, colors)
    assert _line_color(panel(fig, "mean reward"), "turn 1") != _line_color(
        panel(fig, "mean reward"), "turn 2"
    )


def _line_color(ax, label: str) -> str:
    (found,) = [ln for ln in ax.get_lines() if ln.get_label() == label]
    return matplotlib.colors.to_hex(found.get_color())


def test_the_action_shares_stack_to_one_and_a_missing_word_counts_as_zero():
    ax = panel(figure(multi_turn_records()), "first word")
    # By summed share: search 1.5, answer 0.6, click 0.5; "other" last.
    assert [c.get_label() for c in ax.collections] == ["search", "answer", "click", "other"]
    top = band(ax, "other")
    assert {x: hi for x, (_, hi) in top.items()} == pytest.approx({1.0: 1, 2.0: 1, 3.0: 1})
    click, answer = band(ax, "click"), band(ax, "answer")
    assert click[2.0][1] - click[2.0][0] == pytest.approx(0)  # missing at step 2
    assert answer[1.0][1] - answer[1.0][0] == pytest.approx(0)  # missing at step 1
    assert click[3.0][1] - click[3.0][0] == pytest.approx(0.2)
    search = band(ax, "search")
    assert {x: hi - lo for x, (lo, hi) in search.items()} == pytest.approx(
        {1.0: 0.5, 2.0: 0.6, 3.0: 0.4}
    )


def test_rarer_words_than_the_most_common_are_added_to_other():
    records = multi_turn_records()
    words = [f"w{i:02d}" for i in range(MAX_ACTION_WORDS + 2)]
    for record in records[1:]:
        for key in [k for k in record if k.startswith("action_share_")]:
            del record[key]
        for i, word in enumerate(words):  # w00 most common, the last two the rarest
            record[f"action_share_{word}"] = (len(words) - i) / 100
        record["action_share_other"] = 1 - sum(range(1, len(words) + 1)) / 100
    ax = panel(figure(records), "first word")
    assert [c.get_label() for c in ax.collections] == [*words[:MAX_ACTION_WORDS], "other"]
    lo, hi = band(ax, "other")[2.0]
    assert hi == pytest.approx(1)
    assert hi - lo == pytest.approx(records[2]["action_share_other"] + 0.02 + 0.01)


def test_the_loss_shares_stack_to_one_and_a_missing_turn_counts_as_zero():
    ax = panel(figure(multi_turn_records()), "share of the loss")
    top = band(ax, "turn 3")
    assert {x: hi for x, (_, hi) in top.items()} == pytest.approx({1.0: 1, 2.0: 1, 3.0: 1})
    assert {x: hi - lo for x, (lo, hi) in top.items()} == pytest.approx(
        {1.0: 0, 2.0: 1 / 3, 3.0: 0}
    )
    first = band(ax, "turn 1")
    assert {x: hi - lo for x, (lo, hi) in first.items()} == pytest.approx(
        {1.0: 1 / 2, 2.0: 1 / 3, 3.0: 1 / 2}
    )


def test_a_step_without_the_shares_is_left_out_of_the_stacks_not_drawn_as_zero():
    records = multi_turn_records()
    step_one = records[1]
    for key in [k for k in step_one if k.startswith(("action_share_", "turn"))]:
        del step_one[key]
    fig = figure(records)
    assert set(band(panel(fig, "first word"), "other")) == {2.0, 3.0}
    assert set(band(panel(fig, "share of the loss"), "turn 1")) == {2.0, 3.0}
