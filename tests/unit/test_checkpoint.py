import logging

import pytest
import torch

from looprl import checkpoint as ck
from looprl.config import load_config
from looprl.loop import DataStream, resume_point


def _save(run_dir, step, cfg, keep_last=3):
    trainer = {"model": {"w": torch.full((4,), float(step))}, "version": step}
    state = {"data_position": 10 * step, "rng": ck.rng_state()}
    return ck.save(run_dir, step, trainer, state, cfg.model_dump(mode="json"), keep_last)


def _cfg(tmp_path, *overrides):
    return load_config(None, [f"run.fileroot={tmp_path}", *overrides])


def test_round_trip_latest_pointer_and_pruning(tmp_path):
    cfg = _cfg(tmp_path)
    for step in (1, 2, 3, 4):
        path = _save(cfg.run_dir, step, cfg, keep_last=2)
    root = ck.checkpoints_dir(cfg.run_dir)
    assert (root / "latest").read_text() == path.name == "step_000004"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000003", "step_000004"]
    found = ck.load_latest(cfg.run_dir)
    assert found.step == 4 and found.state["data_position"] == 40
    assert torch.equal(found.trainer["model"]["w"], torch.full((4,), 4.0))


@pytest.mark.parametrize("damage", ["truncate", "flip", "unfinished"])
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path, caplog, damage):
    cfg = _cfg(tmp_path)
    _save(cfg.run_dir, 1, cfg)
    newest = _save(cfg.run_dir, 2, cfg)
    target = newest / "trainer.pt"
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    else:  # killed before the manifest was written (a real kill leaves a .tmp-* folder)
        (newest / ck.MANIFEST).unlink()
        (newest.parent / ".tmp-step_000003-1").mkdir()
    with caplog.at_level(logging.WARNING, logger="looprl.checkpoint"):
        found = ck.load_latest(cfg.run_dir)
    assert found.step == 1
    expected = {"truncate": "truncated", "flip": "sha256", "unfinished": "did not finish"}
    assert expected[damage] in caplog.text and "step_000002" in caplog.text
    # Nothing was deleted: the damaged one stays until a newer valid one replaces it.
    assert newest.is_dir()
    _save(cfg.run_dir, 3, cfg)
    assert [p.name for p in newest.parent.iterdir() if p.name.startswith(".tmp")] == []


def test_batch_and_group_size_changes_are_refused_with_every_field(tmp_path):
    old = _cfg(tmp_path, "rollout.batch_size=8", "rollout.group_size=8")
    _save(old.run_dir, 3, old)
    new = _cfg(tmp_path, "rollout.batch_size=4", "rollout.group_size=16")
    with pytest.raises(ck.RecoverError) as refused:
        resume_point(new)
    message = str(refused.value)
    assert "rollout.batch_size: 8 -> 4" in message
    assert "rollout.group_size: 8 -> 16" in message
    assert "recover.allow_changes=[rollout.batch_size,rollout.group_size]" in message

    forced = _cfg(
        tmp_path,
        "rollout.batch_size=4",
        "rollout.group_size=16",
        "recover.allow_changes=[rollout.batch_size,rollout.group_size]",
    )
    assert resume_point(forced).step == 3


def test_harmless_changes_are_accepted_and_listed(tmp_path, caplog):
    old = _cfg(tmp_path)
    _save(old.run_dir, 2, old)
    new = _cfg(tmp_path, "train.total_steps=40", "eval.every_steps=10", "run.log_level=DEBUG")
    with caplog.at_level(logging.INFO, logger="looprl.checkpoint"):
        assert resume_point(new).step == 2
    assert "train.total_steps: 12 -> 40" in caplog.text
    assert "eval.every_steps: 4 -> 10" in caplog.text


def test_recover_modes(tmp_path):
    cfg = _cfg(tmp_path, "run.trial_name=t1")
    assert resume_point(cfg) is None  # auto: nothing yet, a new run
    _save(cfg.run_dir, 1, cfg)
    with pytest.raises(ck.RecoverError, match="checkpoints exist under .*t1"):
        resume_point(_cfg(tmp_path, "run.trial_name=t2", "recover.mode=require"))
    # off: a new run; the old checkpoints are set aside, not mixed with the new ones.
    assert resume_point(_cfg(tmp_path, "run.trial_name=t1", "recover.mode=off")) is None
    assert not ck.checkpoints_dir(cfg.run_dir).exists()
    assert len(list(cfg.run_dir.glob("checkpoints.replaced-*/step_000001"))) == 1


def test_data_stream_seeks_to_what_it_would_have_drawn():
    rows = [{"i": i} for i in range(5)]
    whole = DataStream(rows, seed=3)
    drawn = [next(whole)["i"] for _ in range(13)]  # into the third epoch
    assert sorted(drawn[:5]) == sorted(drawn[5:10]) == list(range(5))
    assert drawn[:5] != drawn[5:10]  # each epoch is shuffled anew
    resumed = DataStream(rows, seed=3)
    resumed.seek(7)
    assert [next(resumed)["i"] for _ in range(6)] == drawn[7:13]
