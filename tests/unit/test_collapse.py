import logging
import math

import pytest

from looprl.config import DiagnosticsConfig
from looprl.diagnostics.collapse import CollapseWatch, action_stats, first_word


def test_the_action_is_the_first_word_lowercased():
    assert first_word("Right, then down") == "right"
    assert first_word("  **DOWN**.") == "down"
    assert first_word("...") == "none"
    assert first_word("_up_") == "up"


def test_action_shares_by_hand():
    replies = ["right", "Right.", "down", "up, then right", "right down", "", "left", "left"]
    stats = action_stats(replies)
    # right 3, left 2, down 1, up 1, none 1 of 8
    assert stats["action_share_right"] == 3 / 8
    assert stats["action_share_left"] == 2 / 8
    assert stats["action_share_none"] == 1 / 8
    assert stats["action_share_other"] == 0.0
    assert stats["action_top_share"] == 3 / 8
    shares = [3 / 8, 2 / 8, 1 / 8, 1 / 8, 1 / 8]
    assert stats["action_entropy"] == pytest.approx(-sum(p * math.log(p) for p in shares))
    assert action_stats([]) == {}


def test_words_beyond_the_top_six_are_other():
    replies = ["a"] * 3 + ["b", "c", "d", "e", "f", "g", "h"]
    stats = action_stats(replies)
    assert stats["action_share_a"] == 0.3
    assert stats["action_share_other"] == pytest.approx(0.2)  # g and h
    assert "action_share_h" not in stats
    assert sum(v for k, v in stats.items() if k.startswith("action_share_")) == pytest.approx(1)


def test_low_entropy_warns_naming_the_settings_that_counter_it(caplog):
    watch = CollapseWatch(DiagnosticsConfig(collapse_entropy=0.05))
    with caplog.at_level(logging.WARNING):
        (message,) = watch.check(7, {"entropy": 0.012})
    assert "Step 7" in message and "0.012" in message
    assert "diagnostics.collapse_entropy=0.05" in message
    for setting in ("train.entropy_coef", "train.eps_clip_high", "train.kl_coef"):
        assert setting in message
    assert message in caplog.text
    assert watch.check(8, {"entropy": 0.3}) == []  # healthy


def test_one_action_taking_over_warns_with_its_name():
    watch = CollapseWatch(DiagnosticsConfig(collapse_action_share=0.9))
    record = {"entropy": 0.4, "action_top_share": 0.95, "action_share_right": 0.95,
              "action_share_down": 0.05, "action_share_other": 0.0}  # fmt: skip
    (message,) = watch.check(3, record)
    assert "95% of the replies begin with 'right'" in message
    assert "train.entropy_coef" in message
    assert watch.check(4, {**record, "action_top_share": 0.6, "action_share_right": 0.6}) == []


def test_a_lasting_collapse_is_repeated_every_ten_steps_not_every_step():
    watch = CollapseWatch(DiagnosticsConfig())
    warned = [step for step in range(1, 25) if watch.check(step, {"entropy": 0.0})]
    assert warned == [1, 11, 21]


def test_zero_threshold_never_warns_on_entropy():
    assert CollapseWatch(DiagnosticsConfig(collapse_entropy=0)).check(1, {"entropy": 0.0}) == []
