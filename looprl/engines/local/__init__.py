"""The in-process PyTorch engine: continuous batching (engine.py) over a model runner
(runners.py), the fused Llama-family forward with cpu and portable kernels (fused.py),
its slot KV cache and prefix store (kv_cache.py), and the sampler (sampling.py)."""

from looprl.engines.local.engine import LocalEngine

__all__ = ["LocalEngine"]
