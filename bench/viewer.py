"""`looprl view` on a 1,000-step run: time to open the overview and to open a step.

Claims measured (goals: overview < 2 s, a step < 300 ms), on a run dir made by
tests/support/synthetic_run.py: 1,000 train records and 101 evals in metrics.jsonl,
and 1,000 trajectory files of 32 rows x 200 tokens. `looprl view` runs as a subprocess
and is measured from outside, with:
- httpx: the overview's requests (page, script, style, run list, overview JSON), first
  time (the server's cache empty) and again (median); a step's JSON the first time
  (median over distinct steps) and again (cached); a search of all 1,000 steps;
- baselines in the same run: metrics.jsonl read with `json.loads` per line and dumped
  again (what the overview must at least do), and a step file read with
  `pyarrow.parquet.read_table(...).to_pylist()` and `json.dumps` (what a step must);
- headless Chromium (Playwright), when /usr/bin/chromium is there: from navigation to
  every plot drawn, and from asking for a step and group to its 8 rollouts drawn with
  their tokens.

    .venv/bin/python bench/viewer.py [--steps 1000] [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from looprl.runs.trajectories import step_path  # noqa: E402
from tests.support.chromium import CHROMIUM_ARGS, find_chromium  # noqa: E402
from tests.support.serving import free_port, running_server  # noqa: E402
from tests.support.synthetic_run import write_synthetic_run  # noqa: E402

OVERVIEW_URLS = ("/", "/static/app.js", "/static/style.css", "/api/runs", "/api/runs/0/overview")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_ms(fn, repeats: int) -> float:
    return 1000 * statistics.median(timed(fn) for _ in range(repeats))


def open_overview(client: httpx.Client) -> int:
    size = 0
    for url in OVERVIEW_URLS:
        response = client.get(url)
        response.raise_for_status()
        size += len(response.content)
    return size


def baseline_overview(run_dir: Path) -> None:
    with (run_dir / "metrics.jsonl").open() as f:
        records = [json.loads(line) for line in f]
    json.dumps(records)


def baseline_step(run_dir: Path, step: int) -> None:
    json.dumps(pq.read_table(step_path(run_dir, step)).to_pylist())


def browser_timings(base: str, steps: list[int], repeats: int) -> dict[str, float] | None:
    chromium = find_chromium()
    if chromium is None:
        print("no Chromium: the page-load timings are left out (apt-get install chromium)")
        return None
    from playwright.sync_api import sync_playwright

    overview, step = [], []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        for i in range(repeats):
            start = time.perf_counter()
            page.goto(f"{base}/?load={i}")  # a new document each time, not a hash change
            page.wait_for_selector('svg[data-plot="step-time"] path.series', state="attached")
            overview.append(time.perf_counter() - start)
            n = steps[(i * 37) % len(steps)]
            start = time.perf_counter()
            page.evaluate(f"location.hash = 'steps/0/{n}/g{n}-0'")
            page.wait_for_function(
                "document.querySelectorAll('#step-panel .rollout').length === 8 && document"
                f".querySelector('#step-panel .summary').textContent.startsWith('step {n} ')"
            )
            step.append(time.perf_counter() - start)
        tokens = page.locator("#step-panel .tok").count()
        browser.close()
    return {
        "overview_ms": 1000 * statistics.median(overview),
        "step_ms": 1000 * statistics.median(step),
        "tokens_drawn": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        took = timed(lambda: write_synthetic_run(run_dir, steps=args.steps, eval_every=10))
        files = list((run_dir / "trajectories").iterdir())
        mib = sum(f.stat().st_size for f in files) / 2**20
        kib = (run_dir / "metrics.jsonl").stat().st_size / 2**10
        print(
            f"synthetic run: {args.steps} steps, {len(files)} trajectory files, {mib:.0f} MiB, "
            f"metrics.jsonl {kib:.0f} KiB (written in {took:.0f} s)"
        )
        port = free_port()
        command = [sys.executable, "-m", "looprl.cli", "view", str(run_dir), "--port", str(port)]
        base = f"http://127.0.0.1:{port}"
        steps = list(range(1, args.steps + 1))
        with running_server(command, port), httpx.Client(base_url=base) as client:
            overview_cold = 1000 * timed(lambda: open_overview(client))
            overview_bytes = open_overview(client)
            overview_warm = median_ms(lambda: open_overview(client), args.repeats)
            picks = steps[:: max(1, len(steps) // args.repeats)][: args.repeats]
            step_cold = 1000 * statistics.median(
                timed(lambda n=n: client.get(f"/api/runs/0/steps/{n}").raise_for_status())
                for n in picks
            )
            step_bytes = len(client.get(f"/api/runs/0/steps/{picks[0]}").content)
            step_warm = median_ms(
                lambda: client.get(f"/api/runs/0/steps/{picks[0]}").raise_for_status(),
                args.repeats,
            )
            search = 1000 * timed(
                lambda: client.get("/api/runs/0/search", params={"q": "needle500x3"})
            )
            browser = browser_timings(base, steps, max(3, args.repeats // 2))
        base_overview = median_ms(lambda: baseline_overview(run_dir), args.repeats)
        base_step = statistics.median(
            1000 * timed(lambda n=n: baseline_step(run_dir, n)) for n in picks
        )

    print(f"\n{'what':<52} {'ms':>8} {'vs baseline':>12}")
    rows = [
        ("baseline: metrics.jsonl json.loads + json.dumps", base_overview, None),
        (
            f"overview over HTTP, first ({overview_bytes / 2**10:.0f} KiB)",
            overview_cold,
            base_overview,
        ),
        ("overview over HTTP, again", overview_warm, base_overview),
        ("baseline: step file read_table.to_pylist + json.dumps", base_step, None),
        (f"step over HTTP, first ({step_bytes / 2**10:.0f} KiB)", step_cold, base_step),
        ("step over HTTP, again (cached)", step_warm, base_step),
        (f"search of all {args.steps} steps over HTTP", search, None),
    ]
    if browser:
        rows += [
            ("Chromium: page to all plots drawn", browser["overview_ms"], base_overview),
            (
                f"Chromium: step to 8 rollouts drawn ({browser['tokens_drawn']} tokens)",
                browser["step_ms"],
                base_step,
            ),
        ]
    for name, ms, baseline in rows:
        ratio = f"{ms / baseline:.1f}x" if baseline else ""
        print(f"{name:<52} {ms:>8.1f} {ratio:>12}")


if __name__ == "__main__":
    main()
