"""looprl: train any LLM agent with reinforcement learning."""

from looprl import runtime

runtime.apply_forced_cpu()  # before any part of looprl imports torch (LOOPRL_FORCE_CPU=avx2)
