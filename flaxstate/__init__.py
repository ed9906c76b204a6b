"""flaxstate: the functional side of training JAX/Flax models.

An immutable train state, a data-parallel training loop that is a Python
generator, and checkpoints that survive crashes and restore anywhere.
"""

from flaxstate.train_state import FlaxOptimTrainState, InferenceState, StateMismatchError, TrainState

__all__ = [
    "FlaxOptimTrainState",
    "InferenceState",
    "StateMismatchError",
    "TrainState",
]

__version__ = "0.1.0"
