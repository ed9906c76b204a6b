"""Checkpoints: records, what lands on disk, writers, readers and summaries."""

from flaxstate.checkpoint.readers import (
    CheckpointFileReader,
    HighestCheckpointFileReader,
    LowestCheckpointFileReader,
)
from flaxstate.checkpoint.records import Checkpoint, CheckpointFile, Summary
from flaxstate.checkpoint.storage import CheckpointError, CheckpointSaveError
from flaxstate.checkpoint.summaries import SummaryLogger, SummaryWriter
from flaxstate.checkpoint.writers import (
    CheckpointFileWriter,
    HighestCheckpointFileWriter,
    LowestCheckpointFileWriter,
)

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointFile",
    "CheckpointFileReader",
    "CheckpointFileWriter",
    "CheckpointSaveError",
    "HighestCheckpointFileReader",
    "HighestCheckpointFileWriter",
    "LowestCheckpointFileReader",
    "LowestCheckpointFileWriter",
    "Summary",
    "SummaryLogger",
    "SummaryWriter",
]
