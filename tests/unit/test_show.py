from dataclasses import replace

import torch
from typer.testing import CliRunner

from looprl.cli import app
from looprl.commands.show import PROMPT_STYLE, SAMPLED_STYLES, _ranges, tokens
from looprl.rollout.outcome import RolloutResult
from looprl.runs.paths import RunPaths, frame_file
from looprl.runs.trajectories import step_path, step_rows, write_step
from looprl.training.batch import build_batch
from tests.support.trajectory_step import call, outcome, step_fixture, token_text


def write_run(run_dir, steps=(1, 3)):
    rollout, batch, trainer = step_fixture()
    for step in steps:
        write_step(run_dir, step, step_rows(step, 4, rollout, batch, trainer, token_text))


def show(*args):
    return CliRunner().invoke(app, ["show", *map(str, args)], env={"COLUMNS": "200"})


def test_show_prints_the_latest_steps_first_row(tmp_path):
    write_run(tmp_path)
    done = show(tmp_path)
    assert done.exit_code == 0, done.output
    assert "step_000003.parquet: row 0 of 4" in done.output
    assert "step 3  group g1  sample 0  dataset row 7  session sA" in done.output
    # (1 - 2/3) / (1/sqrt(3) + 1e-6) = 0.577349; A1 was sampled at version 3
    assert "reward 1  advantage +0.5773  staleness 1  policy version 4" in done.output
    assert "engine vs trainer logprob |diff|: mean 0.25" in done.output  # -0.25 vs -0.5
    assert "user: hello" in done.output
    assert "assistant (reply): reply a1" in done.output
    assert "<1><2><5><6>" in done.output  # the tokens, each decoded alone
    assert "concat break: call 2's prompt" in done.output


def test_show_picks_the_step_group_and_index(tmp_path):
    write_run(tmp_path)
    done = show(tmp_path, "--step", 1, "--group", "g2")
    assert done.exit_code == 0, done.output
    assert "step_000001.parquet: row 0 of 1" in done.output
    assert "group g2" in done.output and "reply c1" in done.output
    done = show(tmp_path, "--index", 2)
    assert "session sB" in done.output and "reply b1" in done.output


def test_show_names_the_episodes_frames_when_they_were_saved(tmp_path):
    write_run(tmp_path)
    assert "frames:" not in show(tmp_path).output
    frames = frame_file(RunPaths(tmp_path).frames, "sA")  # env.frames_every's file of sA
    frames.parent.mkdir()
    frames.write_bytes(b"GIF89a")
    assert f"frames: {frames}" in show(tmp_path).output
    assert "frames:" not in show(tmp_path, "--index", 2).output  # session sB: none


def test_show_explains_what_is_missing_in_one_line(tmp_path):
    done = show(tmp_path)
    assert done.exit_code == 1
    assert done.output.count("\n") == 1 and "no trajectory files" in done.output

    write_run(tmp_path)
    done = show(tmp_path, "--step", 2)
    assert done.exit_code == 1 and "steps written: 1, 3" in done.output
    done = show(tmp_path, "--index", 4)
    assert done.exit_code == 1 and "--index 4 is out of range: there are 4 rows" in done.output
    done = show(tmp_path, "--group", "nope")
    assert done.exit_code == 1 and "no row of group 'nope'" in done.output


def test_show_names_a_corrupt_file(tmp_path):
    write_run(tmp_path)
    step_path(tmp_path, 3).write_bytes(b"garbage")
    done = show(tmp_path)
    assert done.exit_code == 1
    assert done.output.startswith("error: ") and done.output.count("\n") == 1
    assert str(step_path(tmp_path, 3)) in done.output


def test_show_prints_the_models_terminal_escapes_as_text(tmp_path):
    """A completion may hold terminal escapes: OSC 52 writes the clipboard, CSI 2J clears
    the screen, C1 CSI (0x9b) on some terminals. None reaches the terminal raw; newlines
    and tabs do (rich writes a tab as spaces)."""
    evil = "copy\x1b]52;c;ZWNobyBwd25lZA==\x07 then\x1b[2J clear\x9b\nnext\tline"
    said = [{"role": "user", "content": evil}]
    interaction = replace(call("e1", [1, 2], [5, 6], 3, said), output_text=evil)
    rollout = RolloutResult([outcome([interaction], 1.0, "g\x1b[2J", "sE", 0)], elapsed_s=1.0)
    batch, _ = build_batch(rollout.trajectories, "grpo", pad_token_id=0)
    trainer = torch.full(batch.input_ids.shape, -0.25)
    write_step(tmp_path, 1, step_rows(1, 1, rollout, batch, trainer, lambda ids: [evil] * len(ids)))
    done = show(tmp_path)
    assert done.exit_code == 0, done.output
    assert not any(ord(c) < 0x20 and c not in "\n\t" or 0x7F <= ord(c) < 0xA0 for c in done.output)
    shown = r"copy\x1b]52;c;ZWNobyBwd25lZA==\x07 then\x1b[2J clear\x9b" + "\nnext"
    assert f"user: {shown}" in done.output and f"assistant (reply): {shown}" in done.output
    assert r"group g\x1b[2J" in done.output  # every field of the row, not only the text


def test_tokens_are_styled_by_the_loss_mask():
    row = {"token_text": ["a", "b", "c", "d", "e"], "loss_mask": [False, True, True, False, True]}
    text = tokens(row)
    assert text.plain == "abcde"
    styles = [(text.plain[s.start : s.end], s.style) for s in text.spans]
    assert styles == [
        ("a", PROMPT_STYLE),
        ("b", SAMPLED_STYLES[0]),
        ("c", SAMPLED_STYLES[1]),  # neighbours alternate, so each token shows
        ("d", PROMPT_STYLE),
        ("e", SAMPLED_STYLES[0]),
    ]


def test_ranges():
    assert _ranges([1, 2, 3, 5, 7, 8]) == "1-3, 5, 7-8"
