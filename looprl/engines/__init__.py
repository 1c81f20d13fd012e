"""Inference engines: the Engine protocol and its implementations."""

from looprl.engines.base import Engine, EngineError

__all__ = ["Engine", "EngineError"]
