"""Checkpoints on orbax: writers, readers, the best-checkpoint policy, and what a run directory holds."""

from flaxstate.checkpoint.best import BestPolicy
from flaxstate.checkpoint.readers import (
    CheckpointFileReader,
    HighestCheckpointFileReader,
    LowestCheckpointFileReader,
)
from flaxstate.checkpoint.stores.orbax_manager import CheckpointError, CheckpointSaveError
from flaxstate.checkpoint.writers import (
    CheckpointFileWriter,
    HighestCheckpointFileWriter,
    LowestCheckpointFileWriter,
)

__all__ = [
    "BestPolicy",
    "CheckpointError",
    "CheckpointFileReader",
    "CheckpointFileWriter",
    "CheckpointSaveError",
    "HighestCheckpointFileReader",
    "HighestCheckpointFileWriter",
    "LowestCheckpointFileReader",
    "LowestCheckpointFileWriter",
]
