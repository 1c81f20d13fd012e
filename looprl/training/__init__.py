"""Training: trajectories -> batches -> advantages -> (decoupled) PPO updates.

Arrows point down: batch.py uses advantages.py; trainer.py uses batch.py and losses.py.
Nothing here knows about engines, sessions or HTTP.
"""

from looprl.training.batch import TrainBatch, build_batch
from looprl.training.trainer import Trainer

__all__ = ["TrainBatch", "Trainer", "build_batch"]
