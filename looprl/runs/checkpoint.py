"""Recover checkpoints: written atomically, verified by checksums, refused with reasons.

Owns the layout under the run's checkpoints folder (`RunPaths.checkpoints`):

    step_000012/   trainer.safetensors + trainer.json (model, optimizer, scheduler,
                   version), state.safetensors + state.json (data position, controller,
                   metrics, RNG), config.yaml, MANIFEST.json (step)
    latest         the name of the newest checkpoint, replaced last

Nothing is unpickled. Each state is split in two: every tensor goes into a safetensors
file (a header and raw bytes, which cannot run code), and everything else into JSON
where a tensor stands as {"__tensor__": key}; tuples and dicts with non-string keys (an
optimizer's parameter ids) are spelled out so they come back as they were. A checkpoint
of the earlier format (trainer.pt, state.pkl: Python pickles, which run whatever code
was written into them) is refused with a RecoverError saying how to convert it
(`looprl convert-checkpoint PATH --trust-pickle`, for files you trust) or start fresh.

A checkpoint is written into a temporary folder, every file fsynced, MANIFEST.json (size
and sha256 of every other file) written last, the folder renamed into place and the
parent fsynced, then `latest` replaced the same way (`atomic_write_text(fsync=True)`;
the fsyncs are looprl/runs/atomic.py's). Loading walks checkpoints newest first and
skips, with a warning, any whose files do not match their manifest (a kill during a
write leaves only a `.tmp-*` folder, which is never read).

Pruning (each removal logged with its size and the reason): after a save, the one just
written and the `keep_last - 1` whole ones before it are kept; older ones go, and so do
damaged ones older than it and any newer one (left by the run this one resumed
before, which went further: those steps are being trained again). Nothing is pruned
when the new one is not whole, so the checkpoint a run resumed from stays until a newer
whole one exists. A run that finishes removes them all (`finish`) unless asked to keep
them; a run cut short never reaches `finish` and keeps its newest.

Knows nothing of training: the loop hands it a state and gets one back. Its functions
take the run directory, its root or its RunPaths.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file, save_file

from looprl.runs.atomic import atomic_write_text, fsync_dir, fsync_file
from looprl.runs.paths import RunPaths

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
CONFIG = "config.yaml"  # the checkpoint's copy of the run's resolved config
PICKLED = ("trainer.pt", "state.pkl")  # the earlier format's files
# Changing one of these makes the saved state mean something else: refused unless named
# in recover.allow_changes. A prefix ending in "." covers its whole section.
BREAKING = (
    "model.",
    "task.",
    "rollout.batch_size",
    "rollout.group_size",
    "train.algorithm",
    "run.seed",
)


class RecoverError(RuntimeError):
    """Resuming is not possible or not allowed; the message says why and what to do."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    trainer: dict[str, Any]
    state: dict[str, Any]
    config: dict[str, Any]


def checkpoints_dir(run_dir: Path | RunPaths) -> Path:
    return RunPaths.of(run_dir).checkpoints


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def save(
    run_dir: Path | RunPaths,
    step: int,
    trainer_state: dict[str, Any],
    state: dict[str, Any],
    config: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write checkpoint `step` atomically, point `latest` at it, prune to `keep_last`
    (`checkpoint.keep_last`)."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    for stale in root.glob(".tmp-*"):  # left by a process killed while writing
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    tmp.mkdir()
    save_tree(trainer_state, tmp, "trainer")
    save_tree(state, tmp, "state")
    (tmp / CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))
    files = {}
    for path in sorted(tmp.iterdir()):
        fsync_file(path)
        files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {"step": step, "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    fsync_file(tmp / MANIFEST)
    fsync_dir(tmp)
    final = root / name
    if final.exists():  # the same step saved again (e.g. on stop right after a save)
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_dir(root)
    atomic_write_text(root / "latest", name, fsync=True)
    _prune(root, final, keep_last)
    return final


def load_latest(run_dir: Path | RunPaths) -> Checkpoint | None:
    """The newest checkpoint whose files match its manifest; None when there is none."""
    for path in _candidates(checkpoints_dir(run_dir)):
        refuse_pickled(path)
        manifest, problem = _verified_manifest(path, hashes=True)
        if problem:
            log.warning("Skipping checkpoint %s: %s; trying the previous one", path, problem)
            continue
        return Checkpoint(
            path=path,
            step=manifest["step"],
            trainer=load_tree(path, "trainer"),
            state=load_tree(path, "state"),
            config=yaml.safe_load((path / CONFIG).read_text()),
        )
    return None


def refuse_pickled(path: Path) -> None:
    """RecoverError for a checkpoint of the earlier, pickled format; it is never read."""
    found = [name for name in PICKLED if (path / name).exists()]
    if found:
        raise RecoverError(
            f"Checkpoint {path} holds {' and '.join(found)}: the earlier format, Python "
            "pickles, which run whatever code was written into them when loaded, so looprl "
            "no longer reads them. If you trust these files (your own run, nobody else "
            f"could write there), convert it: looprl convert-checkpoint {path} "
            "--trust-pickle. Otherwise start fresh: recover.mode=off, or a new "
            "run.trial_name"
        )


# ---- tensors in safetensors, the rest in JSON ------------------------------------------


def save_tree(tree: Any, folder: Path, name: str) -> None:
    """Write `tree` (dicts, lists, tuples, tensors, str/int/float/bool/None) as
    `name.safetensors` (its tensors) and `name.json` (the rest, tensors by key)."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def encode(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            key = f"t{len(tensors)}"
            tensor = node.detach().cpu()
            # safetensors refuses tensors that share memory (tied weights, views): those
            # are copied, the others written from where they are (no second 1.6 GB).
            storage = tensor.untyped_storage()
            whole = tensor.is_contiguous() and tensor.storage_offset() == 0
            if (
                storage.data_ptr() in storages
                or not whole
                or storage.nbytes() != (tensor.numel() * tensor.element_size())
            ):
                tensor = tensor.clone()
            storages.add(tensor.untyped_storage().data_ptr())
            tensors[key] = tensor
            return {"__tensor__": key}
        if isinstance(node, dict):
            if all(isinstance(k, str) for k in node) and "__tensor__" not in node:
                return {k: encode(v) for k, v in node.items()}
            return {"__items__": [[encode(k), encode(v)] for k, v in node.items()]}
        if isinstance(node, tuple):
            return {"__tuple__": [encode(v) for v in node]}
        if isinstance(node, list):
            return [encode(v) for v in node]
        if isinstance(node, float) and not math.isfinite(node):
            return {"__float__": repr(node)}
        if node is None or isinstance(node, str | int | float | bool):
            return node
        raise TypeError(
            f"a checkpoint holds tensors, containers and plain values; got "
            f"{type(node).__name__}: {node!r:.80}"
        )

    skeleton = encode(tree)
    save_file(tensors, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.json").write_text(json.dumps(skeleton, allow_nan=False))


def load_tree(folder: Path, name: str) -> Any:
    """What save_tree wrote, tensors on the CPU."""
    tensors = load_file(str(folder / f"{name}.safetensors"))

    def decode(node: Any) -> Any:
        if isinstance(node, list):
            return [decode(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "__tensor__" in node:
            return tensors[node["__tensor__"]]
        if "__tuple__" in node:
            return tuple(decode(v) for v in node["__tuple__"])
        if "__items__" in node:
            return {decode(k): decode(v) for k, v in node["__items__"]}
        if "__float__" in node:
            return float(node["__float__"])
        return {k: decode(v) for k, v in node.items()}

    return decode(json.loads((folder / f"{name}.json").read_text()))


def convert_pickled(path: Path) -> None:
    """Rewrite a checkpoint of the earlier format in the current one, in place. Unpickles
    its files: only for checkpoints the user trusts (`looprl convert-checkpoint`)."""
    import pickle  # only here, on the user's explicit request

    path = Path(path)
    if not all((path / name).is_file() for name in PICKLED):
        raise RecoverError(f"{path} has no {' and '.join(PICKLED)} to convert")
    manifest, problem = _verified_manifest(path, hashes=True)
    if problem:
        raise RecoverError(f"Not converting {path}: {problem}")
    trainer = torch.load(path / "trainer.pt", weights_only=False)
    state = pickle.loads((path / "state.pkl").read_bytes())
    save_tree(trainer, path, "trainer")
    save_tree(state, path, "state")
    for name in PICKLED:
        (path / name).unlink()
    files = {}
    for file in sorted(path.iterdir()):
        if file.name != MANIFEST:
            fsync_file(file)
            files[file.name] = {"bytes": file.stat().st_size, "sha256": _sha256(file)}
    (path / MANIFEST).write_text(json.dumps({"step": manifest["step"], "files": files}, indent=1))
    fsync_file(path / MANIFEST)


def verify(path: Path, *, hashes: bool = True) -> str | None:
    """None when every file of the checkpoint matches its manifest, else what is wrong.
    `hashes=False` checks presence and sizes only (no read of the data)."""
    return _verified_manifest(path, hashes=hashes)[1]


def config_changes(
    old: dict[str, Any], new: dict[str, Any], allow: list[str]
) -> tuple[list[str], list[str]]:
    """(refused, accepted) changes between a checkpoint's config and this run's, each as
    `field: old -> new`. Breaking fields named in `allow` are accepted."""
    before, after = _flatten(old), _flatten(new)
    refused, accepted = [], []
    for key in sorted(set(before) | set(after)):
        if before.get(key) == after.get(key):
            continue
        line = f"{key}: {before.get(key)!r} -> {after.get(key)!r}"
        breaking = any(key == p or (p.endswith(".") and key.startswith(p)) for p in BREAKING)
        if breaking and key not in allow:
            refused.append(line)
        else:
            accepted.append(line)
    return refused, accepted


def check_config(checkpoint: Checkpoint, config: dict[str, Any], allow: list[str]) -> None:
    """Refuse to resume across a breaking change (RecoverError names every one); log the
    accepted ones."""
    refused, accepted = config_changes(checkpoint.config, config, allow)
    if refused:
        fields = [line.split(":", 1)[0] for line in refused]
        raise RecoverError(
            f"Cannot resume from {checkpoint.path}: the config changed in ways that change "
            "what the saved state means:\n"
            + "\n".join(f"  {line}" for line in refused)
            + "\nRestore these values, start a new trial (run.trial_name=...), set "
            "recover.mode=off to start over here, or force it with "
            f"recover.allow_changes=[{','.join(fields)}]"
        )
    if accepted:
        log.info("Resuming with config changes: %s", "; ".join(accepted))


def describe_missing(run_dir: Path | RunPaths) -> str:
    """Why there is nothing to resume here, naming sibling trials that have checkpoints."""
    paths = RunPaths.of(run_dir)
    trials = (RunPaths(p) for p in paths.root.parent.parent.glob("*/*") if p.is_dir())
    others = sorted(
        str(trial.root)
        for trial in trials
        if trial.root != paths.root and any(_candidates(trial.checkpoints))
    )
    hint = f"; checkpoints exist under {', '.join(others)}" if others else ""
    if paths.model.is_dir():  # the usual case: this trial finished and pruned them
        hint += (
            f"; {paths.model} is there: a run here finished and removed its recover "
            "checkpoints (checkpoint.keep_on_finish=true keeps them, to continue a finished "
            "trial with a larger train.total_steps)"
        )
    return f"no checkpoint under {paths.checkpoints}{hint}"


def set_aside(run_dir: Path | RunPaths) -> Path | None:
    """Before a new run in a folder that has checkpoints: move them to
    `checkpoints.replaced-<time>` (kept, never read again) and return where."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir() or not any(root.iterdir()):
        return None
    aside = root.with_name(f"checkpoints.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    root.rename(aside)
    log.warning("Moved the checkpoints of an earlier run in %s to %s", root.parent, aside)
    return aside


def _candidates(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)


def _verified_manifest(path: Path, *, hashes: bool) -> tuple[dict[str, Any], str | None]:
    """The checkpoint's manifest ({} when unreadable) and what is wrong with its files,
    None when nothing is: `verify`, and the manifest for `load_latest` from one read."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return {}, f"no {MANIFEST} (the write did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as e:
        return {}, f"unreadable {MANIFEST}: {e}"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return manifest, f"{name} is missing"
        size = file.stat().st_size
        if size != expected["bytes"]:
            return manifest, (
                f"{name} has {size} bytes, the manifest says {expected['bytes']} (truncated)"
            )
        if hashes and _sha256(file) != expected["sha256"]:
            return manifest, f"{name} does not match its sha256 (corrupted)"
    return manifest, None


def _prune(root: Path, written: Path, keep_last: int) -> None:
    """After `written` is in place: keep it and the `keep_last - 1` whole checkpoints
    before it, remove the rest (see the module docstring), each with a log line."""
    # Sizes only: hashing every kept checkpoint again on each save cost ~10 s for
    # SmolLM2's 1.6 GB ones; loading checks the hashes.
    problem = verify(written, hashes=False)
    if problem:  # then the older ones may be all there is to resume from
        log.warning(
            "Pruned no recover checkpoint: the new one, %s, is not whole: %s", written, problem
        )
        return
    kept = 1
    for path in _candidates(root):
        if path.name > written.name:
            _remove(
                path,
                f"newer than {written.name}, which this run just wrote: it resumed from an "
                "earlier checkpoint and trains those steps again",
            )
        elif path.name < written.name:
            problem = verify(path, hashes=False)
            if problem:
                _remove(path, f"damaged ({problem}), and {written.name} is newer and whole")
            elif kept < keep_last:
                kept += 1
            else:
                # Named, as the loop logs the new checkpoint's save after this line.
                newest = (
                    f"the newest, {written.name}"
                    if keep_last == 1
                    else f"the newest {keep_last}, up to {written.name}"
                )
                _remove(path, f"checkpoint.keep_last={keep_last} keeps {newest}")


def finish(run_dir: Path | RunPaths, *, keep: bool) -> list[Path]:
    """The run finished (its model is saved): remove its recover checkpoints unless
    `keep` (`checkpoint.keep_on_finish`), each with a log line; returns the removed ones.
    Earlier runs' checkpoints set aside beside them (`set_aside`) are not touched, only
    named with their size."""
    root = checkpoints_dir(run_dir)
    found = _candidates(root)
    if keep:
        if found:
            log.info(
                "Run finished: kept recover checkpoint%s %s (%s; checkpoint.keep_on_finish=true)",
                "s" * (len(found) > 1),
                ", ".join(p.name for p in found),
                _size_text(sum(_bytes(p) for p in found)),
            )
        return []
    hint = "keep them with checkpoint.keep_on_finish=true"
    for path in found:
        _remove(path, hint, finished=True)
    if root.is_dir():
        for stale in root.glob(".tmp-*"):  # a write killed in an earlier attempt
            shutil.rmtree(stale, ignore_errors=True)
        (root / "latest").unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: files looprl did not write
            root.rmdir()
    for aside in sorted(root.parent.glob(f"{root.name}.replaced-*")):
        log.info(
            "Checkpoints of an earlier run in this folder are still in %s (%s), set aside "
            "when a new run started here; delete that folder if you do not need them",
            aside,
            _size_text(_bytes(aside)),
        )
    return found


def _remove(path: Path, why: str, *, finished: bool = False) -> None:
    size = _size_text(_bytes(path))
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():  # a permission or a busy mount: the run goes on, the user is told
        log.warning("Could not remove recover checkpoint %s (%s): remove it by hand", path, size)
    elif finished:
        log.info("Run finished: removed recover checkpoint %s (%s; %s)", path.name, size, why)
    else:
        log.info("Removed recover checkpoint %s (%s): %s", path.name, size, why)


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _size_text(size: int) -> str:
    """`size` bytes as a person reads it: 1.7 GB, 540 MB, 12 kB (powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.{1 if size < 10 * scale else 0}f} {unit}"
    return f"{size} bytes"


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
