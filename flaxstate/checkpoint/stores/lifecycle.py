"""How a step becomes complete, and the safe order of what undoes it: renamed into place, or a marker written last.

There are only two ways, and orbax names them (`AtomicRenameTemporaryPath`,
`CommitFileTemporaryPath`):

- `RenameIntoPlace(mark)`: a disk. A save writes `<step><mark>...` and
  renames it to `<step>` once whole, so a listed step is whole. A step is
  deleted by renaming it out of the listing first.
- `CommitMarker(marker)`: a bucket, which has no rename. A save writes into
  `<step>/` and writes `marker` last, so a step is whole where its marker is.
  A step is deleted marker first, and set aside by copy, marker, delete.

Each answers what a store asks of its steps: which are complete, which
saves did not finish, how a step leaves the listing (set aside, files kept)
and how it is removed, each in the order in which no reader ever takes half
a step. `beyond_keep` is the rotation of the stores that rotate themselves
(orbax's directory rotates through its `CheckpointManager`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from flaxstate import locations
from flaxstate.checkpoint import saving


class Lifecycle(Protocol):
    """What makes a step of a directory complete, and how it leaves (`RenameIntoPlace`, `CommitMarker`)."""

    def complete(self, directory: Path) -> list[int]:
        """The complete steps, oldest first."""
        ...

    def unfinished(self, directory: Path, step: int | None = None) -> list[Path]:
        """What saves that did not finish (or are running) left: of `step`, or of every step."""
        ...

    def set_aside(self, step_dir: Path, suffix: str) -> Path:
        """Moves a complete step out of the listing (`<step><suffix>`), keeping its files; returns the new path."""
        ...

    def delete(self, step_dir: Path) -> None:
        """Removes a complete step; a reader never takes it half removed."""
        ...


def _of(path: Path, step: int | None) -> bool:
    return step is None or path.name.split(".")[0] == str(step)


@dataclasses.dataclass(frozen=True)
class RenameIntoPlace:
    """A disk: a save writes `<step><mark>...`, then renames it to `<step>`.

    Attributes:
        mark: what a save in progress holds in its directory's name.
    """

    mark: str

    def complete(self, directory: Path) -> list[int]:
        if not directory.is_dir():
            return []
        return sorted(int(path.name) for path in directory.iterdir() if path.name.isdigit())

    def unfinished(self, directory: Path, step: int | None = None) -> list[Path]:
        if not directory.is_dir():
            return []
        return [
            path
            for path in directory.iterdir()
            if self.mark in path.name and path.name.split(".")[0].isdigit() and _of(path, step)
        ]

    def set_aside(self, step_dir: Path, suffix: str) -> Path:
        target = saving.aside(step_dir, suffix)
        step_dir.rename(target)
        return target

    def delete(self, step_dir: Path) -> None:
        """Renames the step out of the listing (as an unfinished save of this process), then removes it."""
        going = step_dir.with_name(f"{step_dir.name}{self.mark}{os.getpid()}-removed")
        try:
            os.rename(step_dir, going)
        except FileNotFoundError:
            return
        shutil.rmtree(going, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class CommitMarker:
    """A bucket: a save writes into `<step>/`, and `marker` last.

    Attributes:
        marker: the file whose presence makes `<step>/` a complete step.
    """

    marker: str

    def complete(self, directory: Path) -> list[int]:
        locations.forget_listings(directory)
        if not directory.is_dir():
            return []
        return sorted(
            int(path.name) for path in directory.iterdir() if path.name.isdigit() and (path / self.marker).exists()
        )

    def unfinished(self, directory: Path, step: int | None = None) -> list[Path]:
        locations.forget_listings(directory)
        if not directory.is_dir():
            return []
        return [
            path
            for path in directory.iterdir()
            if path.name.isdigit() and not (path / self.marker).exists() and _of(path, step)
        ]

    def set_aside(self, step_dir: Path, suffix: str) -> Path:
        """Copies the step to `<step><suffix>`, deletes its marker, then the rest (a bucket has no rename)."""
        target = saving.aside(step_dir, suffix)
        locations.move_tree(step_dir, target, commit_marker=self.marker)
        return target

    def delete(self, step_dir: Path) -> None:
        """Deletes the marker first, so that no reader takes the step half deleted, then the rest."""
        try:
            (step_dir / self.marker).unlink()
        except FileNotFoundError:
            pass
        locations.remove_tree(step_dir)


def beyond_keep(steps: list[int], keep: int | None, rank: Callable[[int], Any] | None = None) -> list[int]:
    """The steps a store that keeps `keep` deletes: the oldest, or with `rank` (lower is better) the worst.

    Ties of `rank` keep the newer step.
    """
    if keep is None:
        return []
    if rank is None:
        return sorted(steps)[: max(0, len(steps) - keep)]
    return sorted(steps, key=lambda step: (rank(step), -step))[keep:]
