"""Checkpoints on orbax: writers, readers, the save and best-checkpoint policies, and what a run directory holds."""

from flaxstate.checkpoint.best import BestPolicy
from flaxstate.checkpoint.budget import HostMemoryBudget
from flaxstate.checkpoint.policies import (
    AutoInterval,
    Continuous,
    EveryRecord,
    EverySeconds,
    RunHistory,
    SaveContext,
    SaveDecision,
    SavePolicy,
)
from flaxstate.checkpoint.readers import (
    CheckpointFileReader,
    HighestCheckpointFileReader,
    LowestCheckpointFileReader,
)
from flaxstate.checkpoint.stores.orbax_manager import CheckpointError, CheckpointSaveError
from flaxstate.checkpoint.tiers.local_tier import LocalTier
from flaxstate.checkpoint.writers import (
    CheckpointFileWriter,
    HighestCheckpointFileWriter,
    LowestCheckpointFileWriter,
)

__all__ = [
    "AutoInterval",
    "BestPolicy",
    "CheckpointError",
    "CheckpointFileReader",
    "CheckpointFileWriter",
    "CheckpointSaveError",
    "Continuous",
    "EveryRecord",
    "EverySeconds",
    "HighestCheckpointFileReader",
    "HighestCheckpointFileWriter",
    "HostMemoryBudget",
    "LocalTier",
    "LowestCheckpointFileReader",
    "LowestCheckpointFileWriter",
    "RunHistory",
    "SaveContext",
    "SaveDecision",
    "SavePolicy",
]
