"""Rollouts: running the user's workflow against gateway sessions, turning what the
sessions recorded into trajectories, and deciding which rollouts may start and which
results are fresh enough to train on (the staleness policy)."""

from looprl.rollout.controller import RolloutController
from looprl.rollout.outcome import RolloutResult

__all__ = ["RolloutController", "RolloutResult"]
