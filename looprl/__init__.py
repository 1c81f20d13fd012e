"""looprl: train any LLM agent with reinforcement learning."""

from looprl import forced_cpu

forced_cpu.apply()  # before any part of looprl imports torch (LOOPRL_FORCE_CPU=avx2)
