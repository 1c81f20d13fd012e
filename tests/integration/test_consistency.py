"""`looprl debug consistency` with the local engine on a real (tiny) model.

A float32 engine against a float32 trainer must agree to float32 rounding; a bfloat16
engine must not (so the report measures something); the worst tokens must be the
tokens with the largest differences, decoded, at their completion positions.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from looprl.commands.consistency import check_consistency
from looprl.config import load_config
from looprl.models import load_tokenizer

pytestmark = pytest.mark.kernels  # run again on a forced AVX2 CPU by make test


def _config(model_dir, tmp_path, *overrides):
    return load_config(
        None,
        [
            f"model.path={model_dir}",
            "sampling.max_new_tokens=16",
            f"run.fileroot={tmp_path}",
            *overrides,
        ],
    )


async def test_float32_engine_and_trainer_agree(tiny_model_dir, tmp_path):
    cfg = _config(tiny_model_dir, tmp_path, "engine.dtype=float32", "train.compute_dtype=float32")
    (report,) = await check_consistency(cfg, ["local"], samples=4, worst=3)
    assert report.engine == "local" and report.samples == 4
    assert 4 <= report.tokens <= 4 * 16
    assert report.max_abs_diff < 1e-4
    assert report.kl < 1e-6
    assert report.ratio_outside_frac == 0


async def test_top_k_top_p_logprobs_agree_when_the_trainer_truncates_alike(
    tiny_model_dir, tmp_path
):
    """The engine's logprobs under top-k / top-p are renormalized over the tokens it kept;
    the trainer takes the same set (as in training), and they agree. Its full softmax,
    the second report, does not."""
    truncation = ["sampling.top_k=20", "sampling.top_p=0.9"]
    cfg = _config(
        tiny_model_dir, tmp_path, "engine.dtype=float32", "train.compute_dtype=float32", *truncation
    )
    same, full = await check_consistency(cfg, ["local"], samples=4, worst=2)
    print(same.summary(), full.summary())
    assert same.engine == "local" and full.engine == "local, trainer untruncated"
    assert same.tokens == full.tokens >= 4
    assert same.max_abs_diff < 1e-4 and same.kl < 1e-6 and same.ratio_outside_frac == 0
    assert full.mean_abs_diff > 0.5 and full.ratio_outside_frac > 0.5


async def test_bfloat16_engine_differences_and_worst_tokens(tiny_model_dir, tmp_path):
    cfg = _config(tiny_model_dir, tmp_path, "engine.dtype=bfloat16", "train.compute_dtype=float32")
    (report,) = await check_consistency(cfg, ["local"], samples=4, worst=4)
    print(report.summary())
    assert 1e-3 < report.mean_abs_diff < 0.1
    assert report.max_abs_diff >= report.mean_abs_diff
    assert report.kl > 0
    diffs = [w.abs_diff for w in report.worst]
    assert len(diffs) == 4 and diffs == sorted(diffs, reverse=True)
    assert diffs[0] == pytest.approx(report.max_abs_diff)
    tokenizer = load_tokenizer(tiny_model_dir)
    for w in report.worst:
        assert 0 <= w.sample < 4 and 0 <= w.position < 16
        assert w.token == tokenizer.decode([w.token_id])


def test_the_command_prints_the_report_per_engine(tiny_model_dir, tmp_path):
    command = [sys.executable, "-m", "looprl.cli", "debug", "consistency"]
    args = [f"model.path={tiny_model_dir}", "sampling.max_new_tokens=8", f"run.fileroot={tmp_path}"]
    done = subprocess.run(
        [*command, *args, "--samples", "2", "--engines", "local", "--worst", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},  # the summary's 7 columns, unwrapped
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    headings = ("mean |diff|", "max |diff|", "KL(engine||trainer)", "ratio outside [0.5, 2]")
    for heading in (*headings, "worst tokens: local"):
        assert heading in out
    assert "trainer logprob" in out and "position" in out

    bad = subprocess.run(
        [*command, *args, "--engines", "local,tensorrt"], capture_output=True, text=True
    )
    assert bad.returncode == 2
    assert "--engines='local,tensorrt'" in bad.stderr
