"""`looprl view RUN_DIR [RUN_DIR ...]`: serve the viewer page until Ctrl-C.

Checks each folder is a run directory (it holds one of config.yaml, metrics.jsonl,
trajectories/, by their `RunPaths` names: `run_files`) before anything starts. Read-only
and without a key: on loopback (the default) only this machine reaches it; on another
address anyone who reaches the port reads the runs' configs, metrics and trajectories.
"""

from __future__ import annotations

import logging
from pathlib import Path

import uvicorn

from looprl.gateway.server import is_loopback
from looprl.runs.paths import RunPaths
from looprl.viewer.app import create_app

log = logging.getLogger(__name__)


def run_files(paths: RunPaths) -> tuple[Path, ...]:
    """The files of which a run directory holds at least one: config.yaml as soon as a
    run starts, metrics.jsonl, trajectories/."""
    return (paths.config, paths.metrics, paths.trajectories)


def view_runs(run_dirs: list[Path], host: str = "127.0.0.1", port: int = 8765) -> None:
    """Serve the page for `run_dirs` at http://host:port/ until Ctrl-C or SIGTERM.

    Raises ValueError, before serving, for a folder that is missing or holds none of
    `run_files` (config.yaml, metrics.jsonl, trajectories/).
    """
    for run_dir in run_dirs:
        check_run_dir(run_dir)
    loopback = is_loopback(host)
    if not loopback:
        log.warning(
            "Serving on %s without a key: anyone who reaches port %d reads these runs "
            "(configs, metrics, every prompt and completion)",
            host,
            port,
        )
    app = create_app(run_dirs, loopback_host=host if loopback else None)
    shown = f"[{host}]" if ":" in host else host
    print(f"looprl view: http://{shown}:{port}/ ({len(run_dirs)} run(s); Ctrl-C to stop)")
    uvicorn.run(app, host=host, port=port, log_level="warning")


def check_run_dir(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise ValueError(
            f"{run_dir} is not a folder: give a run directory (<root>/<experiment>/<trial>)"
        )
    files = run_files(RunPaths(run_dir))
    if not any(path.exists() for path in files):
        names = ", ".join(path.name for path in files)
        raise ValueError(
            f"{run_dir} holds none of {names}: not a run directory (a run "
            "writes them into run.fileroot/<experiment>/<trial>, e.g. runs/default/trial0)"
        )
