"""`looprl view` in a real browser: the command runs as a subprocess, headless Chromium
(Playwright) opens the page, and each test checks what a user would see against the run
dir's files: points per plot, rollouts per group, trained tokens per rollout, search
hits, error banners, a run that grows while the page is open.

Run dirs come from tests/support/synthetic_run.py (numbers a test can predict) and, in
the last test, from a short real `looprl train` of the tiny model.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from looprl.runs.trajectories import read_step, step_path, write_step
from tests.support.chromium import CHROMIUM_ARGS, find_chromium
from tests.support.serving import free_port, running_server
from tests.support.synthetic_run import metric_records, trajectory_rows, write_synthetic_run
from tests.support.tiny_run import tiny_run_overrides

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'"
)
expect = sync_api.expect

# The whole module runs in make test-slow, which installs Chromium (up to 11 min).
pytestmark = pytest.mark.browser

STEPS = 20
ROWS = 32  # 4 groups of 8


@pytest.fixture(scope="module")
def browser():
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium found: apt-get install chromium (make test-slow does)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    """A fresh page; a JavaScript error on it fails the test."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, errors


@contextmanager
def viewing(*run_dirs: Path) -> Iterator[str]:
    """`looprl view RUN_DIR...` on a free port; yields the page's URL."""
    port = free_port()
    command = [sys.executable, "-m", "looprl.cli", "view", *map(str, run_dirs), "--port", str(port)]
    with running_server(command, port):
        yield f"http://127.0.0.1:{port}/"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return write_synthetic_run(
        tmp_path_factory.mktemp("viewer") / "run", steps=STEPS, rows_per_step=ROWS
    )


@pytest.fixture(scope="module")
def url(run_dir) -> Iterator[str]:
    with viewing(run_dir) as url:
        yield url


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def path_commands(page, plot: str, label: str) -> str:
    """The M (pen down) and L (line to) commands of a plotted series: one per point."""
    d = page.get_attribute(f'svg[data-plot="{plot}"] path[data-label="{label}"]', "d")
    return "".join(re.findall(r"[ML]", d))


def hover_center_of_first_box(page, selector: str) -> None:
    """Hover an inline element where it is drawn (a wrapped token's bounding box may
    centre on another element)."""
    box = page.eval_on_selector(
        selector,
        "e => { const r = e.getClientRects()[0]; return [r.x + r.width / 2, r.y + r.height / 2]; }",
    )
    page.mouse.move(*box)


def test_the_plots_show_every_record_and_hovering_names_step_and_value(page, url, run_dir):
    train, evals = records(run_dir, "train"), records(run_dir, "eval")
    page.goto(url)
    page.wait_for_selector('svg[data-plot="reward"] path.series')

    assert path_commands(page, "reward", "train reward") == "M" + "L" * (len(train) - 1)
    assert len(path_commands(page, "accuracy", "held-out success")) == len(evals) == 3
    # kl is null on steps 7 and 14: the line breaks there, three pieces of 18 points.
    kl = path_commands(page, "kl", "kl")
    assert (len(kl), kl.count("M")) == (STEPS - 2, 3)
    for plot in ("mismatch", "staleness", "throughput"):
        assert page.locator(f'svg[data-plot="{plot}"] path.series').count() >= 2

    plot = page.locator('svg[data-plot="reward"]').bounding_box()
    page.mouse.move(plot["x"] + plot["width"] * 0.6, plot["y"] + plot["height"] / 2)
    text = page.inner_text("#tooltip")
    step = int(re.search(r"step (\d+)", text).group(1))
    value = float(re.search(r"train reward: (\S+)", text).group(1))
    assert 1 <= step <= STEPS
    assert value == pytest.approx(train[step - 1]["reward_mean"], rel=1e-3)

    page.mouse.click(plot["x"] + plot["width"] * 0.6, plot["y"] + plot["height"] / 2)
    expect(page.locator("#step-panel .step-input")).to_have_value(str(step))
    expect(page.locator("#steps")).to_be_visible()
    expect(page.locator("#config")).to_contain_text("total_steps")


def test_a_group_shows_its_rollouts_with_each_trained_token_marked(page, url, run_dir):
    rows = read_step(step_path(run_dir, 5))
    page.goto(url + "#steps/0/5")
    page.click('#step-panel tr.group-row[data-group="g5-1"]')

    cards = page.locator("#step-panel .rollout")
    expect(cards).to_have_count(8)
    for index in range(8, 16):
        row, card = rows[index], page.locator(f'#step-panel .rollout[data-index="{index}"]')
        assert card.locator(".tok.m").count() == sum(row["loss_mask"])
        assert card.locator(".tok").count() == len(row["token_ids"])
        expect(card.locator(".head")).to_contain_text(f"reward {row['reward']:g}")
    expect(page.locator('#step-panel .rollout[data-index="11"]')).to_have_class(
        re.compile("has-error")
    )
    expect(page.locator('#step-panel .rollout[data-index="11"] .errorbox')).to_contain_text(
        "ValueError"
    )

    row = rows[9]
    hover_center_of_first_box(page, '#step-panel .rollout[data-index="9"] .tok[data-i="50"]')
    text = page.inner_text("#tooltip")
    engine = float(re.search(r"engine logprob (\S+)", text).group(1))
    trainer = float(re.search(r"trainer logprob (\S+)", text).group(1))
    assert engine == pytest.approx(row["engine_logprobs"][50], abs=1e-3)
    assert trainer == pytest.approx(row["trainer_logprobs"][50], abs=1e-3)
    assert f"version {row['token_versions'][50]}" in text

    page.click('#step-panel tr.group-row[data-group="g5-0"]')
    expect(page.locator('#step-panel .rollout[data-index="5"] .breakbox')).to_contain_text(
        "concat break"
    )


def test_the_filters_keep_the_groups_with_a_match_and_dim_the_other_rollouts(page, url):
    page.goto(url + "#steps/0/5/g5-1")
    expect(page.locator("#step-panel .rollout")).to_have_count(8)
    page.check('#step-panel input[data-flag="errors"]')
    # Errors on rows 0, 11 and 22: groups 0, 1 and 2 of the step.
    groups = page.locator("#step-panel tr.group-row")
    expect(groups).to_have_count(3)
    assert "g5-3" not in groups.all_inner_texts()
    expect(page.locator("#step-panel .rollout:not(.dim)")).to_have_count(1)
    page.check('#step-panel input[data-flag="truncated"]')  # and truncated: row 0 only
    expect(groups).to_have_count(1)


def test_search_finds_a_string_in_any_step_and_opens_its_rollout(page, url):
    page.goto(url + "#steps")
    page.fill("#step-panel input.search", "needle13x20")
    page.click("#step-panel button.search-all")
    hits = page.locator("#step-panel .hit-row")
    expect(hits).to_have_count(1)
    assert hits.get_attribute("data-step") == "13"
    hits.click()
    expect(page.locator("#step-panel .step-input")).to_have_value("13")
    card = page.locator('#step-panel .rollout[data-index="20"]')
    expect(card).to_have_class(re.compile("flash"))
    expect(card.locator(".tok.hit")).to_have_count(1)
    expect(card.locator(".tok.hit")).to_have_text(" needle13x20")


def test_corrupt_files_show_banners_naming_them_and_the_rest_still_shows(page, tmp_path):
    run = write_synthetic_run(tmp_path / "run", steps=5, rows_per_step=8)
    step_path(run, 3).write_bytes(b"PAR1 this is not a parquet file")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines.insert(2, '{"kind": "train", "step": ')
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "config.yaml").write_text("train: [unclosed\n")

    with viewing(run) as url:
        page.goto(url)
        banners = page.locator("#banners .banner")
        expect(banners.filter(has_text="metrics.jsonl line 3: not JSON")).to_have_count(1)
        expect(banners.filter(has_text="config.yaml: not valid YAML")).to_have_count(1)
        assert len(path_commands(page, "reward", "train reward")) == 5
        expect(page.locator("#config")).to_contain_text("train: [unclosed")

        page.goto(url + "#steps/0/3")
        expect(
            banners.filter(has_text="trajectories/step_000003.parquet: not a readable Parquet file")
        ).to_have_count(1)
        expect(page.locator("#step-panel .summary")).to_contain_text("could not be shown")
        page.goto(url + "#steps/0/4")
        expect(page.locator("#step-panel tr.group-row")).to_have_count(1)


def test_the_runs_warnings_are_banners_the_latest_of_each_kind(page, tmp_path):
    """Records of kind "warning" (diagnostics/learning.py's) are warn banners, one per
    name (its latest), and no error banner."""
    run = write_synthetic_run(tmp_path / "run", steps=5, rows_per_step=8)
    with (run / "metrics.jsonl").open("a") as f:
        for step, name in [(1, "truncated"), (1, "equal_rewards"), (5, "truncated")]:
            message = f"Step {step}: {name} says what to change"
            f.write(json.dumps({"kind": "warning", "step": step, "name": name, "message": message}))
            f.write("\n")

    with viewing(run) as url:
        page.goto(url)
        banners = page.locator("#banners .banner.warn")
        expect(banners).to_have_count(2)
        expect(banners.filter(has_text="Step 1: equal_rewards says")).to_have_count(1)
        expect(banners.filter(has_text="Step 5: truncated says")).to_have_count(1)
        expect(page.locator("#banners .banner:not(.warn)")).to_have_count(0)


def test_a_run_in_progress_fills_in_while_the_page_is_open(page, tmp_path):
    run = write_synthetic_run(tmp_path / "run", steps=10, rows_per_step=8, eval_every=5)
    every = metric_records(10, 5)
    write_records(run, [r for r in every if r["step"] <= 6])
    for step in range(7, 11):
        step_path(run, step).unlink()

    with viewing(run) as url:
        page.goto(url)
        expect(page.locator("#status")).to_contain_text("step 6 / 10")
        assert len(path_commands(page, "reward", "train reward")) == 6
        page.click("nav a[data-tab=steps]")
        expect(page.locator("#step-panel .step-input")).to_have_value("6")

        for step in range(7, 11):
            write_step(run, step, trajectory_rows(step, 8, 8, 200))
        write_records(run, every)
        page.wait_for_function(
            "document.querySelector('svg[data-plot=reward] path.series').dataset.points === '10'",
            timeout=15_000,
        )
        expect(page.locator("#status")).to_contain_text("step 10 / 10 · finished")
        page.click("#step-panel button:text('latest')")
        expect(page.locator("#step-panel .step-input")).to_have_value("10")
        expect(page.locator("#step-panel tr.group-row")).to_have_count(1)


def write_records(run: Path, rows: list[dict]) -> None:
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_two_runs_compare_on_the_plots_and_step_by_step(page, run_dir, tmp_path):
    other = write_synthetic_run(tmp_path / "other", steps=8, rows_per_step=8)
    with viewing(run_dir, other) as url:
        page.goto(url)
        page.wait_for_selector('svg[data-plot="reward"] path.series')
        page.select_option("#overlay", "1")
        paths = page.locator('svg[data-plot="reward"] path.series')
        expect(paths).to_have_count(2)
        assert len(path_commands(page, "reward", "train reward")) == STEPS
        overlay = paths.nth(1).get_attribute("d")
        assert overlay.count("L") == 8 - 1

        page.click("nav a[data-tab=compare]")
        expect(page.locator("#compare-a .summary")).to_contain_text("step 1 ")
        expect(page.locator("#compare-b .summary")).to_contain_text("step 8 ")
        expect(page.locator("#compare-b .summary")).to_contain_text("8 rollouts")
        page.fill("#compare-a .step-input", "2")
        page.press("#compare-a .step-input", "Enter")
        expect(page.locator("#compare-a .summary")).to_contain_text("step 2 ")


def with_turn_metrics(rows: list[dict]) -> list[dict]:
    """`rows` with a multi-turn run's train keys: 2 turn positions on even steps and 3 on
    odd ones; first words "search" (0.5), "click" (odd steps) or "answer" (even), "other"."""
    for row in rows:
        if row["kind"] != "train":
            continue
        step = row["step"]
        turns = 2 + step % 2
        row["degenerate_group_share"] = step / 100
        for k in range(1, turns + 1):
            row[f"turn{k}_samples"] = 8
            row[f"turn{k}_return_mean"] = step + k / 10
            row[f"turn{k}_advantage_mean"] = 0.0
            row[f"turn{k}_advantage_abs_mean"] = k + step / 100
            row[f"turn{k}_entropy"] = 2.0 - k / 10
            row[f"turn{k}_loss_share"] = 1 / turns
        word = "click" if step % 2 else "answer"
        row |= {"action_share_search": 0.5, f"action_share_{word}": 0.2, "action_share_other": 0.3}
        row |= {"action_top_share": 0.5, "action_entropy": 1.0}
    return rows


def stack_edges(page, plot: str, label: str) -> list[tuple[float, float]]:
    """A stacked band's (top, bottom) y per point, in the drawing's coordinates."""
    d = page.get_attribute(f'svg[data-plot="{plot}"] path.area[data-label="{label}"]', "d")
    ys = [float(y) for y in re.findall(r"[\d.]+,([\d.]+)", d)]
    half = len(ys) // 2
    return list(zip(ys[:half], reversed(ys[half:]), strict=True))


def test_a_multi_turn_run_shows_the_turns_panel_and_a_single_turn_run_does_not(page, url, tmp_path):
    steps = 6
    run = write_synthetic_run(tmp_path / "turns", steps=steps, rows_per_step=8)
    write_records(run, with_turn_metrics(metric_records(steps, 5)))
    with viewing(run) as turns_url:
        page.goto(turns_url)
        expect(page.locator("#turns")).to_be_visible()
        advantage = page.locator('svg[data-plot="turn-advantage"] path.series')
        expect(advantage).to_have_count(3)
        assert [advantage.nth(i).get_attribute("data-label") for i in range(3)] == [
            "turn 1",
            "turn 2",
            "turn 3",
        ]
        assert len(path_commands(page, "turn-advantage", "turn 1")) == steps
        assert path_commands(page, "turn-advantage", "turn 3") == "MMM"  # odd steps only
        expect(page.locator('svg[data-plot="turn-return"] path.series')).to_have_count(3)
        expect(page.locator('svg[data-plot="turn-entropy"] path.series')).to_have_count(4)
        assert len(path_commands(page, "turn-entropy", "all turns")) == steps
        collapse = "groups with equal returns"
        assert len(path_commands(page, "turn-collapse", collapse)) == steps

        areas = page.locator('svg[data-plot="turn-actions"] path.area')
        assert [areas.nth(i).get_attribute("data-label") for i in range(areas.count())] == [
            "search",
            "answer",  # ties "click" (3 steps of 0.2 each): by name
            "click",
            "other",
        ]
        top = 8.0  # the drawing's y of a share of 1 (its top margin)
        assert [t for t, _ in stack_edges(page, "turn-actions", "other")] == [top] * steps
        answer = stack_edges(page, "turn-actions", "answer")
        thick = [bottom - t > 1 for t, bottom in answer]
        assert thick == [step % 2 == 0 for step in range(1, steps + 1)]  # missing: 0
        loss = page.locator('svg[data-plot="turn-loss"] path.area')
        expect(loss).to_have_count(3)
        assert [t for t, _ in stack_edges(page, "turn-loss", "turn 3")] == [top] * steps

        actions = page.locator('svg[data-plot="turn-actions"]')
        actions.scroll_into_view_if_needed()
        plot = actions.bounding_box()
        page.mouse.move(plot["x"] + plot["width"] * 0.95, plot["y"] + plot["height"] / 2)
        lines = page.inner_text("#tooltip").splitlines()
        assert lines[0] == f"step {steps}"
        assert {"search: 0.5", "answer: 0.2", "click: 0"} <= set(lines)  # missing: 0

        options = page.locator("#extra-metric option").all_inner_texts()
        assert "turn2_samples (train)" in options  # not drawn by the panel
        assert "turn2_entropy (train)" not in options

    page.goto(url)
    page.wait_for_selector('svg[data-plot="reward"] path.series')
    expect(page.locator("#turns")).to_be_hidden()
    expect(page.locator("#turn-plots svg")).to_have_count(0)


def test_view_refuses_a_folder_that_is_not_a_run_dir(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "looprl.cli", "view", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "not a run directory" in done.stderr


@pytest.mark.slow
def test_a_real_training_run(page, tmp_path, tiny_model_dir):
    """A short `looprl train` of the tiny model, then its plots and trained tokens."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "looprl.cli",
            "train",
            *tiny_run_overrides(
                tiny_model_dir,
                tmp_path,
                "train.total_steps=3",
                "rollout.group_size=4",
                "sampling.max_new_tokens=8",
                "eval.size=4",
                "eval.max_new_tokens=8",
            ),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    run = tmp_path / "default" / "trial0"
    rows = read_step(step_path(run, 2))
    first_group = [i for i, r in enumerate(rows) if r["group_id"] == rows[0]["group_id"]]

    with viewing(run) as url:
        page.goto(url)
        expect(page.locator("#status")).to_contain_text("step 3 / 3 · finished")
        assert len(path_commands(page, "reward", "train reward")) == 3
        assert len(path_commands(page, "accuracy", "held-out success")) == 2  # steps 0 and 3

        page.goto(url + "#steps/0/2")
        page.click(f'#step-panel tr.group-row[data-group="{rows[0]["group_id"]}"]')
        expect(page.locator("#step-panel .rollout")).to_have_count(len(first_group))
        for index in first_group:
            card = page.locator(f'#step-panel .rollout[data-index="{index}"]')
            assert card.locator(".tok.m").count() == sum(rows[index]["loss_mask"]) > 0
        first_trained = rows[0]["loss_mask"].index(True)
        hover_center_of_first_box(
            page, f'#step-panel .rollout[data-index="0"] .tok[data-i="{first_trained}"]'
        )
        text = page.inner_text("#tooltip")
        engine = float(re.search(r"engine logprob (\S+)", text).group(1))
        assert engine == pytest.approx(rows[0]["engine_logprobs"][first_trained], abs=1e-3)
        assert f"version {rows[0]['token_versions'][first_trained]}" in text
