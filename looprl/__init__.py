"""looprl: train any LLM agent with reinforcement learning."""
