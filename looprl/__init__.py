"""looprl: train any LLM agent with reinforcement learning.

The public names, for using looprl from Python (docs/quickstart.md, "From Python"):
`load_config` and `Config` (the typed config), `train` (the training loop, async) and
the `TrainSummary` it returns, and for agents `Workflow` (the protocol) and
`RLVRWorkflow` (one chat turn scored by a reward function). They are imported on first
use, so that `import looprl` (and the `looprl` command's start) stays light.
"""

from looprl import runtime

runtime.apply_forced_cpu()  # before any part of looprl imports torch (LOOPRL_FORCE_CPU=avx2)

__all__ = ["Config", "RLVRWorkflow", "TrainSummary", "Workflow", "load_config", "train"]

_WHERE = {
    "Config": "looprl.config",
    "load_config": "looprl.config",
    "train": "looprl.loop",
    "TrainSummary": "looprl.loop",
    "Workflow": "looprl.workflows",
    "RLVRWorkflow": "looprl.workflows",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'looprl' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)
