"""The in-process PyTorch engine: continuous batching (engine.py) over a model runner
(runners.py), the fused Llama-family forward and its KV cache (fused.py)."""

from looprl.engines.local.engine import LocalEngine

__all__ = ["LocalEngine"]
