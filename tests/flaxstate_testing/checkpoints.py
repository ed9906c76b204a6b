"""What the tests read of a checkpoint directory without flaxstate: its step subdirectories."""

from __future__ import annotations

from pathlib import Path


def saved_steps(directory: Path) -> list[int]:
    """The steps saved in `directory` (its numeric subdirectories), in order."""
    return sorted(int(path.name) for path in Path(directory).iterdir() if path.name.isdigit())
