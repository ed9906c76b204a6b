"""Checkpoints: records, what lands on disk, writers, readers and summaries."""

from flaxstate.checkpoint.records import Checkpoint, CheckpointFile, Summary

__all__ = ["Checkpoint", "CheckpointFile", "Summary"]
