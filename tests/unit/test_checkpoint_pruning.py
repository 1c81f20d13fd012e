"""Which recover checkpoints stay on disk (looprl/runs/checkpoint.py): the newest
`checkpoint.keep_last` while a run goes on, none once it finished unless
`checkpoint.keep_on_finish`; never the one just written or the only whole one; every
removal logged with its size and why. Real checkpoints in tmp_path, no mocks."""

import logging

import pytest
import torch

from looprl.config import ConfigError, load_config
from looprl.runs import checkpoint as ck
from looprl.runs.paths import RunPaths

LOGGER = "looprl.runs.checkpoint"


def _cfg(tmp_path, *overrides):
    return load_config(None, [f"run.fileroot={tmp_path}", *overrides])


def _save(cfg, step, keep_last):
    trainer = {"model": {"w": torch.full((256,), float(step))}, "version": step}
    state = {"data_position": 10 * step, "rng": ck.rng_state()}
    return ck.save(cfg.run_dir, step, trainer, state, cfg.model_dump(mode="json"), keep_last)


def _names(cfg) -> list[str]:
    return sorted(p.name for p in ck.checkpoints_dir(cfg.run_dir).glob("step_*"))


def _flip(checkpoint):
    """Damage the checkpoint as a disk could, keeping its size: only the sha256 tells."""
    target = checkpoint / "trainer.safetensors"
    data = target.read_bytes()
    target.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))


def test_the_defaults_keep_one_while_running_and_none_after():
    cfg = load_config(None, [])
    assert cfg.checkpoint.keep_last == 1 and cfg.checkpoint.keep_on_finish is False
    with pytest.raises(ConfigError, match="keep_last"):
        load_config(None, ["checkpoint.keep_last=0"])


@pytest.mark.parametrize("keep_last", [1, 2])
def test_saving_keeps_the_newest_n_and_says_what_it_removed(tmp_path, caplog, keep_last):
    cfg = _cfg(tmp_path)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for step in (1, 2, 3, 4):
            _save(cfg, step, keep_last)
    assert _names(cfg) == [f"step_{s:06d}" for s in range(5 - keep_last, 5)]
    newest = "the newest, step_000002" if keep_last == 1 else "the newest 2, up to step_000003"
    removed = [r.getMessage() for r in caplog.records if "Removed" in r.getMessage()]
    assert len(removed) == 4 - keep_last
    assert removed[0].startswith("Removed recover checkpoint step_000001 (")
    assert removed[0].endswith(f" kB): checkpoint.keep_last={keep_last} keeps {newest}")
    assert ck.load_latest(cfg.run_dir).step == 4


def test_the_checkpoint_resumed_from_stays_until_a_newer_whole_one_exists(tmp_path, caplog):
    # A run killed after step 3: step 3 is damaged, so the next attempt resumes from 2.
    cfg = _cfg(tmp_path)
    _save(cfg, 2, keep_last=2)
    _flip(_save(cfg, 3, keep_last=2))
    assert ck.load_latest(cfg.run_dir).step == 2
    assert _names(cfg) == ["step_000002", "step_000003"]  # loading deletes nothing

    # It trains step 3 again: the new one replaces the damaged one, then 2 goes.
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _save(cfg, 3, keep_last=1)
    assert _names(cfg) == ["step_000003"]
    assert ck.verify(ck.checkpoints_dir(cfg.run_dir) / "step_000003") is None
    assert "Removed recover checkpoint step_000002" in caplog.text


def test_a_newer_damaged_one_goes_and_the_one_just_written_stays(tmp_path, caplog):
    # Steps 5 and 6 damaged: the run resumes from 4 and writes 5 again. Step 6 is from
    # the attempt it resumed past; with keep_last=1 it must not push out the new step 5.
    cfg = _cfg(tmp_path)
    for step in (4, 5, 6):
        _save(cfg, step, keep_last=3)
    for step in (5, 6):
        _flip(ck.checkpoints_dir(cfg.run_dir) / f"step_{step:06d}")
    assert ck.load_latest(cfg.run_dir).step == 4
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _save(cfg, 5, keep_last=1)
    assert _names(cfg) == ["step_000005"]
    assert ck.load_latest(cfg.run_dir).step == 5
    assert "Removed recover checkpoint step_000006 (" in caplog.text
    assert "newer than step_000005, which this run just wrote" in caplog.text
    assert "Removed recover checkpoint step_000004 (" in caplog.text


def test_damaged_older_ones_go_once_a_newer_one_is_whole(tmp_path, caplog):
    cfg = _cfg(tmp_path)
    _save(cfg, 1, keep_last=3)
    older = _save(cfg, 2, keep_last=3)
    (older / ck.MANIFEST).unlink()  # a write that never finished
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _save(cfg, 3, keep_last=3)
    assert _names(cfg) == ["step_000001", "step_000003"]
    assert "step_000002" in caplog.text and "damaged (no MANIFEST.json" in caplog.text


def test_nothing_is_pruned_when_the_new_one_is_not_whole(tmp_path, caplog):
    cfg = _cfg(tmp_path)
    _save(cfg, 1, keep_last=1)
    new = _save(cfg, 2, keep_last=3)
    (new / "state.safetensors").write_bytes(b"")  # truncated on its way to the disk
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ck._prune(new.parent, new, keep_last=1)
    assert _names(cfg) == ["step_000001", "step_000002"]
    assert "Pruned no recover checkpoint: the new one" in caplog.text
    assert ck.load_latest(cfg.run_dir).step == 1  # the only whole one is still there


def test_a_finished_run_removes_its_checkpoints_and_says_how_to_keep_them(tmp_path, caplog):
    cfg = _cfg(tmp_path)
    _save(cfg, 1, keep_last=2)
    _save(cfg, 2, keep_last=2)
    root = ck.checkpoints_dir(cfg.run_dir)
    (root / ".tmp-step_000003-1").mkdir()  # a write killed in an earlier attempt
    with caplog.at_level(logging.INFO, logger=LOGGER):
        removed = ck.finish(cfg.run_dir, keep=False)
    assert [p.name for p in removed] == ["step_000002", "step_000001"]
    assert not root.exists()  # nor `latest`, nor the killed write's folder
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("Run finished: removed recover checkpoint step_000002 (")
    assert lines[0].endswith(" kB; keep them with checkpoint.keep_on_finish=true)")
    assert ck.load_latest(cfg.run_dir) is None
    assert ck.finish(cfg.run_dir, keep=False) == []  # nothing left: nothing to do


def test_keep_on_finish_keeps_them_for_a_longer_rerun(tmp_path, caplog):
    cfg = _cfg(tmp_path)
    _save(cfg, 2, keep_last=1)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert ck.finish(cfg.run_dir, keep=True) == []
    assert _names(cfg) == ["step_000002"]
    assert "Run finished: kept recover checkpoint step_000002 (" in caplog.text
    assert "checkpoint.keep_on_finish=true" in caplog.text


def test_an_earlier_runs_set_aside_checkpoints_are_named_not_removed(tmp_path, caplog):
    cfg = _cfg(tmp_path)
    _save(cfg, 5, keep_last=1)
    aside = ck.set_aside(cfg.run_dir)  # what recover.mode=off does before a new run
    _save(cfg, 2, keep_last=1)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ck.finish(cfg.run_dir, keep=False)
    assert (aside / "step_000005").is_dir()
    assert f"still in {aside} (" in caplog.text and "delete that folder" in caplog.text


def test_starting_after_a_finished_run_says_why_there_is_nothing_to_resume(tmp_path):
    cfg = _cfg(tmp_path)
    _save(cfg, 2, keep_last=1)
    RunPaths(cfg.run_dir).model.mkdir(parents=True)  # the finished run's model
    ck.finish(cfg.run_dir, keep=False)
    why = ck.describe_missing(cfg.run_dir)
    assert "a run here finished and removed its recover checkpoints" in why
    assert "checkpoint.keep_on_finish=true" in why


@pytest.mark.parametrize(
    ("size", "text"),
    [(1_712_345_678, "1.7 GB"), (540_000_000, "540 MB"), (12_345, "12 kB"), (80, "80 bytes")],
)
def test_sizes_read_as_a_person_says_them(size, text):
    assert ck._size_text(size) == text
