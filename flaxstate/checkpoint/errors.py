"""The errors a caller of the checkpoint package may catch."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read or written as asked."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint save that failed (in the background or not), naming its step and directory."""
