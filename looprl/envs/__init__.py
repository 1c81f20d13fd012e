"""Environments: one contract (base.py), adapters (gymnasium.py, textarena.py,
skyrl.py), the worker processes they run in (workers.py) and rendered frames
(frames.py). The workflow that plays them is looprl.workflows:EnvWorkflow.

The names are imported on first use, so that a worker process imports only what its
environment needs.
"""

__all__ = [
    "EnvCrashed",
    "EnvError",
    "EnvFailed",
    "EnvTimedOut",
    "EnvWorkers",
    "InvalidAction",
    "make_env",
]

_WHERE = {
    "EnvCrashed": "looprl.envs.base",
    "EnvError": "looprl.envs.base",
    "EnvFailed": "looprl.envs.base",
    "EnvTimedOut": "looprl.envs.base",
    "InvalidAction": "looprl.envs.base",
    "make_env": "looprl.envs.base",
    "EnvWorkers": "looprl.envs.workers",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'looprl.envs' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)
