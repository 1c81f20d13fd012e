import logging

import pytest
import torch

from looprl.config import load_config
from looprl.loop import DataStream, resume_point
from looprl.runs import atomic
from looprl.runs import checkpoint as ck
from looprl.runs.paths import RunPaths


def _resume(cfg):
    """The loop's resume point for `cfg`'s run directory."""
    return resume_point(cfg, RunPaths(cfg.run_dir))


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


def test_atomic_write_replaces_the_whole_file_or_keeps_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "latest"
    atomic.atomic_write_text(path, "old")  # the folder is made
    assert path.read_text() == "old"

    def half_then_disk_full(tmp):
        tmp.write_text("ne")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic.atomic_write(path, half_then_disk_full)
    assert path.read_text() == "old"
    assert [p.name for p in path.parent.iterdir()] == ["latest"]  # no temporary left

    synced = []
    monkeypatch.setattr(atomic, "fsync_file", lambda p: synced.append(("file", p.parent)))
    monkeypatch.setattr(atomic, "fsync_dir", lambda p: synced.append(("dir", p)))
    atomic.atomic_write_text(path, "new", fsync=True)  # the temporary file, then the folder
    assert path.read_text() == "new"
    assert synced == [("file", path.parent), ("dir", path.parent)]


@pytest.mark.parametrize("damage", ["truncate", "flip", "unfinished"])
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path, caplog, damage):
    cfg = _cfg(tmp_path)
    _save(cfg.run_dir, 1, cfg)
    newest = _save(cfg.run_dir, 2, cfg)
    target = newest / "trainer.safetensors"
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    else:  # killed before the manifest was written (a real kill leaves a .tmp-* folder)
        (newest / ck.MANIFEST).unlink()
        (newest.parent / ".tmp-step_000003-1").mkdir()
    with caplog.at_level(logging.WARNING, logger="looprl.runs.checkpoint"):
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
        _resume(new)
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
    assert _resume(forced).step == 3


def test_harmless_changes_are_accepted_and_listed(tmp_path, caplog):
    old = _cfg(tmp_path)
    _save(old.run_dir, 2, old)
    new = _cfg(tmp_path, "train.total_steps=40", "eval.every_steps=10", "run.log_level=DEBUG")
    with caplog.at_level(logging.INFO, logger="looprl.runs.checkpoint"):
        assert _resume(new).step == 2
    assert "train.total_steps: 12 -> 40" in caplog.text
    assert "eval.every_steps: 4 -> 10" in caplog.text


def test_recover_modes(tmp_path):
    cfg = _cfg(tmp_path, "run.trial_name=t1")
    assert _resume(cfg) is None  # auto: nothing yet, a new run
    _save(cfg.run_dir, 1, cfg)
    with pytest.raises(ck.RecoverError, match="checkpoints exist under .*t1"):
        _resume(_cfg(tmp_path, "run.trial_name=t2", "recover.mode=require"))
    # off: a new run; the old checkpoints are set aside, not mixed with the new ones.
    assert _resume(_cfg(tmp_path, "run.trial_name=t1", "recover.mode=off")) is None
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


# ---- nothing is unpickled ----------------------------------------------------------------


def test_a_real_trainer_state_round_trips_through_safetensors_and_json(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    # A view of another weight: two tensors on one storage, which safetensors refuses.
    model[1].weight = torch.nn.Parameter(model[0].weight.data[:2, :3])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    schedule.step()
    tree = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),  # int keys, tuples (betas), floats, tensors
        "scheduler": schedule.state_dict(),
        "rng": ck.rng_state(),  # a tuple of 625 ints, a uint8 tensor
        "version": 3,
        "nested": {"inf": float("inf"), "none": None, "pair": (1, "a"), 7: [2.5, True]},
    }
    ck.save_tree(tree, tmp_path, "trainer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trainer.json", "trainer.safetensors"]
    back = ck.load_tree(tmp_path, "trainer")

    def same(a, b):
        assert type(a) is type(b) or isinstance(a, dict) and type(b) is dict, (a, b)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        elif isinstance(a, dict):
            assert list(a) == list(b)
            for key in a:
                same(a[key], b[key])
        elif isinstance(a, list | tuple):
            assert len(a) == len(b)
            for x, y in zip(a, b, strict=True):
                same(x, y)
        else:
            assert a == b

    same(tree, back)
    restored = torch.optim.AdamW(model.parameters(), lr=1e-3)
    restored.load_state_dict(back["optimizer"])  # what the trainer does on resume
    ck.set_rng_state(back["rng"])


class _Payload:
    """Pickled, it runs `touch MARKER` when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _plant_pickles(checkpoint, marker) -> None:
    """The earlier format's files, carrying a payload, with a manifest that matches them:
    only the format check stands between them and pickle."""
    import pickle

    for name in ("trainer.safetensors", "trainer.json", "state.safetensors", "state.json"):
        (checkpoint / name).unlink()
    (checkpoint / "state.pkl").write_bytes(pickle.dumps({"x": _Payload(marker)}))
    torch.save({"model": _Payload(marker)}, checkpoint / "trainer.pt")
    _rewrite_manifest(checkpoint)


def _rewrite_manifest(checkpoint) -> None:
    """A manifest that matches the folder's files, as the earlier looprl wrote it."""
    import hashlib
    import json

    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in checkpoint.iterdir()
        if p.name != ck.MANIFEST
    }
    manifest = json.loads((checkpoint / ck.MANIFEST).read_text())
    (checkpoint / ck.MANIFEST).write_text(json.dumps({**manifest, "files": files}))
    assert ck.verify(checkpoint) is None


def test_a_planted_pickle_is_never_run_and_the_refusal_says_what_to_do(tmp_path):
    cfg = _cfg(tmp_path)
    checkpoint = _save(cfg.run_dir, 2, cfg)
    marker = tmp_path / "pwned"
    _plant_pickles(checkpoint, marker)
    with pytest.raises(ck.RecoverError) as refused:
        ck.load_latest(cfg.run_dir)
    message = str(refused.value)
    assert "trainer.pt and state.pkl" in message and str(checkpoint) in message
    assert "looprl convert-checkpoint" in message and "--trust-pickle" in message
    assert "recover.mode=off" in message
    assert not marker.exists()


def test_looprl_train_refuses_a_planted_pickle_before_it_runs(tmp_path, tiny_model_dir):
    import subprocess
    import sys

    overrides = [f"run.fileroot={tmp_path}", f"model.path={tiny_model_dir}"]
    cfg = _cfg(tmp_path, f"model.path={tiny_model_dir}")
    checkpoint = _save(cfg.run_dir, 2, cfg)
    marker = tmp_path / "pwned"
    _plant_pickles(checkpoint, marker)
    run = subprocess.run(
        [sys.executable, "-m", "looprl.cli", "train", *overrides, "recover.mode=auto"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    said = run.stderr.replace("\n", "")  # rich wraps the message at the terminal's width
    assert "convert-checkpoint" in said and "Traceback" not in run.stdout + run.stderr
    assert not marker.exists()


def test_convert_checkpoint_rewrites_the_old_format_only_when_trusted(tmp_path):
    import subprocess
    import sys

    cfg = _cfg(tmp_path)
    checkpoint = _save(cfg.run_dir, 2, cfg)
    trainer = ck.load_tree(checkpoint, "trainer")
    state = ck.load_tree(checkpoint, "state")
    for name in ("trainer.safetensors", "trainer.json", "state.safetensors", "state.json"):
        (checkpoint / name).unlink()
    torch.save(trainer, checkpoint / "trainer.pt")  # what the earlier looprl wrote
    import pickle

    (checkpoint / "state.pkl").write_bytes(pickle.dumps(state))
    _rewrite_manifest(checkpoint)
    command = [sys.executable, "-m", "looprl.cli", "convert-checkpoint", str(checkpoint)]
    untrusted = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert untrusted.returncode == 2 and "--trust-pickle" in untrusted.stderr.replace("\n", "")
    assert (checkpoint / "state.pkl").exists()
    trusted = subprocess.run(
        [*command, "--trust-pickle"], capture_output=True, text=True, timeout=120
    )
    assert trusted.returncode == 0, trusted.stdout + trusted.stderr
    assert not (checkpoint / "state.pkl").exists() and not (checkpoint / "trainer.pt").exists()
    found = ck.load_latest(cfg.run_dir)
    assert found.step == 2 and found.state["data_position"] == 20
    assert torch.equal(found.trainer["model"]["w"], torch.full((4,), 2.0))
