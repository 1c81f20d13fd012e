"""`pip install .` from a clean checkout: the wheel pip builds holds every module and the
files looprl reads at run time (not only what an editable install finds in the tree),
and, installed on its own, it imports and its `looprl` command runs.

The checkout is the repository's files as git sees them (tracked, or new and not
ignored), copied to a fresh folder: no build/, .egg-info or __pycache__ from this tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[2]


def checkout(to: Path) -> Path:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a file deleted but not yet staged is listed too
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name)
    return to


def test_the_wheel_of_a_clean_checkout_installs_and_runs(tmp_path):
    source = checkout(tmp_path / "checkout")
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, source],
        check=True,
        timeout=240,
    )
    (wheel,) = wheels.glob("looprl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(source).as_posix() for p in (source / "looprl").rglob("*.py")}
    assert modules <= names, f"modules missing from the wheel: {sorted(modules - names)}"
    assert "looprl/engines/servers/auth/looprl_server_auth.py" in names  # vLLM's PYTHONPATH
    assert "looprl/viewer/static/index.html" in names  # the page `looprl view` serves
    assert not any(n.startswith(("tests/", "bench/", "docs/")) for n in names), names

    # Installed alone (its dependencies are this venv's), run from outside the checkout.
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel],
        check=True,
        timeout=120,
    )

    def run_installed(*args) -> str:
        """stdout of this venv's Python run from outside the checkout, the wheel first."""
        return subprocess.run(
            [sys.executable, *args],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(site)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    where = run_installed("-c", "import looprl.cli; print(looprl.cli.__file__)")
    assert Path(where.strip()).is_relative_to(site), where
    shown = run_installed(site / "bin" / "looprl", "--help")
    assert "train" in shown and "doctor" in shown, shown
