"""Separate virtual environments for tools that pin their own torch (vLLM, TRL).

`ensure_venv` creates one the first time it is asked for, with the given packages, and
returns its python; later calls return at once. A failed install removes the half-built
venv, so the next attempt starts clean instead of tripping over it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


class VenvError(RuntimeError):
    """A separate venv could not be created or its packages installed."""


def ensure_venv(venv: Path, install: list[str], remove: list[str] = ()) -> Path:
    """`venv`'s python; creates the venv with `install` (then uninstalls `remove`) if missing."""
    python = venv / "bin" / "python"
    if python.exists():
        return python
    print(f"Creating {venv} with {' '.join(install)} (a few minutes)...", flush=True)
    pip = [str(python), "-m", "pip"]
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([*pip, "install", "-q", *install], check=True)
        if remove:
            subprocess.run([*pip, "uninstall", "-q", "-y", *remove], check=True)
    except subprocess.CalledProcessError as e:
        shutil.rmtree(venv, ignore_errors=True)
        raise VenvError(f"creating {venv} with {' '.join(install)} failed: {e}") from e
    return python
