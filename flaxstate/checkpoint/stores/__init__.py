"""The store a writer saves into: one protocol for a directory of steps, and the one place that picks it.

Three stores implement `Store`:

- `flaxstate.checkpoint.stores.orbax_manager.CheckpointStore`: an orbax directory that
  every process writes together (the run directory, the persistent tier);
  `shared`: only the primary process changes it, and the others wait.
- `flaxstate.checkpoint.stores.local.LocalStore`: this process's own files (the
  local tier, `per_process=True`); each process changes its own.
- `flaxstate.checkpoint.stores.s3.ObjectStore`: an `s3://` run directory,
  whose arrays orbax cannot write (tensorstore's s3 driver); like orbax's,
  every process writes it together and the primary commits.

A writer is written against `Store` alone; `store_directory` and
`open_store` make the choice once, from the path and the options. (A
`gs://` directory is orbax's: it writes gs:// itself.)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from flaxstate.checkpoint.best import BestPolicy
from flaxstate.checkpoint.budget import UNBOUNDED, HostMemoryBudget
from flaxstate.checkpoint.layout import SET_ASIDE, Rename, StoredCheckpoint
from flaxstate.checkpoint.stores.local import Copies, LocalStore, process_directory
from flaxstate.checkpoint.stores.orbax_manager import CheckpointStore
from flaxstate.checkpoint.stores.s3 import ObjectStore, is_object_store


class Store(Protocol):
    """A directory of steps: list, read, save, set aside, remove, and wait for the save in flight.

    Each method is here because a caller above the stores asks it of every
    store, named in its docstring. How a step becomes complete and leaves is
    each store's `flaxstate.checkpoint.stores.lifecycle` strategy; the save
    slot (`save`, `wait`, `settle`, `close`, `prune_aside`) is one shared
    implementation, `flaxstate.checkpoint.saving.SaveSlot`.

    Attributes:
        directory: where its steps are (this process's part, for a per-process store).
        shared: whether every process writes this one directory together
            (then only the primary process changes it), or each its own.
        completed: the step and seconds of the newest save seen complete.
    """

    directory: Path
    shared: bool
    completed: tuple[int, float | None] | None

    def steps(self) -> list[int]:
        """The whole steps, oldest first (every reader and writer, the tiers, the CLI's listing)."""
        ...

    def read_meta(self, step: int) -> dict[str, Any]:
        """A step's meta, checked: damage raises `DamagedCheckpointError` (`steps.classify`, the CLI, a resume)."""
        ...

    def read(
        self, step: int, template: Mapping[str, Any] | None, *, with_optimizer: bool = True, rename: Rename = None
    ) -> StoredCheckpoint:
        """Restores a step into a template state dict's tree and shardings (`None`: numpy arrays of the stored tree).

        `rename` maps stored paths to the template's (a store that cannot
        rename refuses it).
        """
        ...

    def stored_tree(self, step: int, with_optimizer: bool = True) -> dict[str, Any]:
        """A step's state-dict layout, its arrays' shapes and dtypes as leaves, no array read (`flaxstate show`)."""
        ...

    def read_paths(self, step: int, paths: list[str]) -> dict[str, np.ndarray]:
        """Some of a step's arrays, by state-dict path, as numpy, and no other (the EMA's restore, the CLI)."""
        ...

    def unfinished(self) -> list[Path]:
        """The folders of saves that did not finish (or are running), which no reader takes (`steps.classify`)."""
        ...

    def save(
        self, step: int, state_dict: Mapping[str, Any], meta: Mapping[str, Any], metrics: Mapping[str, float] | None
    ) -> None:
        """Starts a save of one step, in the background until `wait` (the writer, at each record it saves)."""
        ...

    def set_aside(self, step: int, suffix: str = SET_ASIDE) -> Path:
        """Moves a step out of the listing (`<step><suffix>`), keeping its files (claims, readers: damage)."""
        ...

    def prune_aside(self, suffix: str, keep: int) -> list[Path]:
        """Removes all but the `keep` steps set aside last as `<step><suffix>` (the claims, after setting aside)."""
        ...

    def remove_unfinished(self, step: int | None = None) -> list[Path]:
        """Removes what saves that did not finish left (the claims at a writer's first save; a failed save)."""
        ...

    def delete(self, steps: list[int]) -> None:
        """Removes whole steps (the claims, with `overwrite=True`)."""
        ...

    def in_flight(self) -> bool:
        """Whether a save still runs, asked without waiting (the writer, with `fs.Continuous` or `fs.AutoInterval`)."""
        ...

    def wait(self) -> None:
        """Waits for the save in flight, raising its failure (the writer, before a save and at its end)."""
        ...

    def settle(self) -> None:
        """Waits for the save in flight, keeping a failure for the next `wait` (at exit: `flaxstate.background`)."""
        ...

    def close(self) -> None:
        """Waits for the save in flight, then releases the store (the writer's close; a reader's `with`)."""
        ...

    def __enter__(self) -> Store: ...

    def __exit__(self, *exc_info: object) -> None: ...


def store_directory(output_dir: Path, *, per_process: bool, subdir: str | None = None) -> Path:
    """Where a writer's steps go: the run directory, a best writer's `subdir` of it, or this process's local part."""
    if per_process:
        return process_directory(output_dir)
    return output_dir / subdir if subdir is not None else output_dir


def open_store(
    directory: Path,
    *,
    per_process: bool,
    keep: int | None = None,
    best: BestPolicy | None = None,
    read_only: bool = False,
    copies: Copies | None = None,
    host_memory_budget: HostMemoryBudget = UNBOUNDED,
) -> Store:
    """The store of `directory` (from `store_directory`): per-process files, an s3:// store, or an orbax directory.

    Args:
        directory: the store's directory.
        per_process: this process's own files (the local tier), or a directory of every process.
        keep: how many steps a writer keeps.
        best: keep the best by a metric instead of the newest (an orbax directory).
        read_only: open for reading: nothing is created.
        copies: the peer copies a local tier hands each save to (`flaxstate.checkpoint.tiers.peers.PeerCopies`).
        host_memory_budget: bytes a save or a restore may hold beyond the state (`flaxstate.checkpoint.budget`).
    """
    if per_process:
        return LocalStore(
            directory, keep=keep, read_only=read_only, copies=copies, host_memory_budget=host_memory_budget
        )
    if is_object_store(directory):
        return ObjectStore(directory, keep=keep, best=best, read_only=read_only, host_memory_budget=host_memory_budget)
    return CheckpointStore(directory, keep=keep, best=best, read_only=read_only, host_memory_budget=host_memory_budget)
