"""The local tier: each process's own checkpoints of the arrays its devices hold, in a directory on its host.

`CheckpointFileWriter(fs.LocalTier(local_dir))` keeps them in
`local_dir/process-<index>/<step>/`, so processes that share a host (and its
`/dev/shm`) never share a directory. A step holds two files:

- `arrays.bin`: the bytes of every array part this process holds, each at
  an offset aligned to 64 bytes (a replicated array once a host);
- `meta.json`: the record's meta as the persistent tier stores it (run id,
  step, key, data position, metrics, the run's environment with its mesh),
  the process index and count and the ids of the devices it was saved
  under, and each array's global shape, dtype and parts (the index of
  each part in the global array, and its offset in `arrays.bin`).

A save is written into `<step>.partial-<pid>`, fsync'd, then renamed to
`<step>`: a step that is listed is whole, and no process waits for another
(no barrier, no shared filesystem). A step whose `arrays.bin` is not the
size its meta names is damaged, and never restored.

A local step restores only where it was saved: the same process index and
count, and for every device of this process the part of each array that the
template's sharding gives it (`parts.covers`). Restoring it is one read
of a file (from memory, on a tmpfs) and one transfer a device. orbax's
per-process checkpointing (its emergency checkpoint manager) does this too,
but is marked experimental ("do not use without specific approval"); what a
local step must hold is only bytes that this process already has, read back
by the same process.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from flaxstate import background, tree_paths
from flaxstate.checkpoint import meta as meta_format
from flaxstate.checkpoint import saving
from flaxstate.checkpoint.budget import UNBOUNDED, HostMemoryBudget
from flaxstate.checkpoint.damage import DamagedCheckpointError
from flaxstate.checkpoint.errors import CheckpointError
from flaxstate.checkpoint.layout import SET_ASIDE, Rename, StoredCheckpoint, state_dict_of, to_json
from flaxstate.checkpoint.saving import Metrics, Tree
from flaxstate.checkpoint.steps import VanishedStepError
from flaxstate.checkpoint.stores.packed import (
    ARRAYS,
    META_FILE,
    STEPS,
    Chunk,
    PartsFile,
    pack_step,
    remove_step,
    step_numbers,
    write_packed,
)
from flaxstate.checkpoint.stores.parts import index_of, wanted
from flaxstate.records import FORMAT_VERSION

logger = logging.getLogger("flaxstate")


def process_directory(local_dir: str | Path, process_index: int | None = None) -> Path:
    """The directory of one process's local steps: `local_dir/process-<index>` (this process's by default)."""
    index = jax.process_index() if process_index is None else process_index
    return Path(local_dir).absolute() / f"process-{index}"


class Handoff(Protocol):
    """What one save's exchange with the peers gave this process (`flaxstate.checkpoint.tiers.peers.Exchanged`)."""

    @property
    def anyone_saved(self) -> bool:
        """Some process holds the step already: every process refuses the save together."""
        ...

    @property
    def packed(self) -> tuple[dict[str, Any], list[Chunk]] | None:
        """This process's step as packed to be sent (written as it is), or `None`."""
        ...

    def keep(self, directory: Path, step: int, keep: int | None) -> None:
        """Writes the other processes' parts that this process keeps, beside its own step (in the save's thread)."""
        ...


class Copies(Protocol):
    """How a save hands this process's parts to its peers (`flaxstate.checkpoint.tiers.peers.PeerCopies`)."""

    def exchange(
        self, saved: bool, flat: Mapping[str, Any], header: dict[str, Any], directory: Path, step: int
    ) -> Handoff:
        """Runs with every process at each save of `step` to `directory`: whether any holds the step already, and
        the parts moved."""
        ...


class LocalStore(saving.SaveSlot):
    """One process's local steps: save (in the background), list, check, read.

    It offers what `CheckpointFileWriter` asks of a store (the persistent
    tier's is `flaxstate.checkpoint.stores.orbax_manager.CheckpointStore`).

    Args:
        directory: this process's directory (`process_directory(local_dir)`).
        keep: how many of the newest steps to keep.
        read_only: open for reading; nothing is created.
    """

    shared = False
    """Each process writes its own directory."""

    def __init__(
        self,
        directory: str | Path,
        keep: int | None = None,
        read_only: bool = False,
        copies: Copies | None = None,
        host_memory_budget: HostMemoryBudget = UNBOUNDED,
    ) -> None:
        super().__init__()
        self.directory = Path(directory).absolute()
        self._keep = keep
        self._copies = copies
        self._block_bytes = host_memory_budget.block_bytes
        if not read_only:
            self.directory.mkdir(parents=True, exist_ok=True)
            background.track(self)

    # Writing.

    def _holds(self, step: int) -> bool:
        return step in self.steps()

    def _start(self, step: int, state_dict: Tree, meta: Tree, metrics: Metrics, *, saved: bool) -> None:
        """This process's parts, in a thread of its own; with peer copies, every process exchanges first."""
        flat = tree_paths.flatten(dict(state_dict))
        header = self._header(meta)
        if self._copies is None:
            if saved:
                raise self.refuse_replacing(step)
            self._pending = saving.BackgroundSave(step, lambda: self._write(step, flat, header, None))
            return
        exchanged = self._copies.exchange(saved, flat, header, self.directory, step)  # all refuse together
        if exchanged.anyone_saved:
            raise self.refuse_replacing(step)
        self._pending = saving.BackgroundSave(step, lambda: self._write(step, flat, header, exchanged))

    def _header(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """The meta that a local step stores besides its arrays: the record's, and where it was saved."""
        return {
            **to_json(dict(meta)),
            "format_version": FORMAT_VERSION,
            "time": time.time(),
            "process_index": jax.process_index(),
            "processes": jax.process_count(),
            "devices": [device.id for device in jax.local_devices()],
        }

    def _write(self, step: int, flat: Mapping[str, Any], header: dict[str, Any], exchanged: Handoff | None) -> None:
        """Writes this process's step, then the copies of other processes' parts that it keeps."""
        packed = exchanged.packed if exchanged is not None else None
        write_packed(self.directory, step, *(packed or pack_step(flat, header, self._block_bytes)), self._keep)
        if exchanged is not None:
            exchanged.keep(self.directory, step, self._keep)

    def unfinished(self) -> list[Path]:
        """The directories of saves that did not finish (killed, failed, or running): `<step>.partial-<pid>`."""
        return STEPS.unfinished(self.directory)

    def remove_unfinished(self, step: int | None = None) -> list[Path]:
        """Removes the directories of saves that did not finish (killed, or failed); returns them."""
        removed = STEPS.unfinished(self.directory, step)
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
        return removed

    def set_aside(self, step: int, suffix: str = SET_ASIDE) -> Path:
        """Moves a step out of the listing (`<step><suffix>`), keeping its files; returns the new path."""
        self.wait()
        return STEPS.set_aside(self.directory / str(step), suffix)

    def delete(self, steps: list[int]) -> None:
        """Removes whole steps."""
        self.wait()
        for step in steps:
            remove_step(self.directory, step)

    # Reading.

    def steps(self) -> list[int]:
        """The steps saved whole (renamed into place), oldest first."""
        return step_numbers(self.directory)

    def read_meta(self, step: int) -> dict[str, Any]:
        """Returns a step's meta, checked against the format and against the size of its arrays' file.

        Raises:
            DamagedCheckpointError: its meta is missing, not JSON or not valid,
                or `arrays.bin` is not the size the meta names (truncated).
            CheckpointError: written by a newer flaxstate.
            VanishedStepError: the step was deleted meanwhile.
        """
        step_dir = self.directory / str(step)
        where = step_dir / META_FILE
        try:
            meta = meta_format.read(where, step_dir)
        except (OSError, DamagedCheckpointError) as error:
            if not step_dir.is_dir():  # renamed out of the listing by a writer's rotation: gone, not damaged
                raise VanishedStepError(f"{step_dir} was deleted while it was read.") from error
            if isinstance(error, DamagedCheckpointError):
                raise
            raise DamagedCheckpointError(f"{where} cannot be read ({error}): the step is damaged") from error
        if not isinstance(meta.get("arrays"), Mapping) or not isinstance(meta.get("bytes"), int):
            raise DamagedCheckpointError(f"{where} names no arrays: the step is damaged")
        try:
            size = (step_dir / ARRAYS).stat().st_size
        except OSError as error:
            raise DamagedCheckpointError(f"{step_dir / ARRAYS} cannot be read ({error}): damaged") from error
        if size != meta["bytes"]:
            raise DamagedCheckpointError(
                f"{step_dir / ARRAYS} holds {size:,} bytes where its meta names {meta['bytes']:,}: the step is damaged"
            )
        return meta

    def stored_tree(self, step: int, with_optimizer: bool = True) -> dict[str, Any]:
        """Returns a step's state-dict layout with `jax.ShapeDtypeStruct`s (global shapes) as leaves."""
        arrays: Mapping[str, Any] = self.read_meta(step)["arrays"]
        flat = {
            path: jax.ShapeDtypeStruct(tuple(entry["shape"]), jnp.dtype(entry["dtype"]))
            for path, entry in arrays.items()
            if with_optimizer or not path.startswith("state/")
        }
        return state_dict_of(flat)

    def read_paths(self, step: int, paths: list[str]) -> dict[str, np.ndarray]:
        """Reads some whole arrays of a step by their state-dict paths, as numpy, and no other.

        Raises:
            CheckpointError: a path the step does not hold.
            DamagedCheckpointError: the file cannot be read whole.
        """
        meta = self.read_meta(step)
        missing = sorted(set(paths) - set(meta["arrays"]))
        if missing:
            raise CheckpointError(f"{self.directory / str(step)} holds no array at {', '.join(missing)}.")
        where = self.directory / str(step) / ARRAYS
        try:
            with PartsFile(where, meta["bytes"]) as parts:
                return {
                    path: np.array(parts.values(entry, [[0, size] for size in entry["shape"]]))
                    for path, entry in ((path, meta["arrays"][path]) for path in paths)
                }
        except OSError as error:
            raise DamagedCheckpointError(f"{where} cannot be read ({error}): the step is damaged") from error

    def read(
        self,
        step: int,
        template: Mapping[str, Any] | None,
        *,
        with_optimizer: bool = True,
        rename: Rename = None,
        meta: Mapping[str, Any] | None = None,
        host_memory_budget: HostMemoryBudget = UNBOUNDED,
    ) -> StoredCheckpoint:
        """Restores a step that `covers` the template: its state dict (the template's tree, on its shardings) and meta.

        Args:
            step: the step.
            template: the state dict to restore into (its shardings); `None`
                restores numpy arrays of the stored tree.
            with_optimizer: read the optimizer's arrays (`state/...`).
            rename: refused: a local step restores only into the model it was saved from.
            meta: the step's meta, when the caller read it already.
            host_memory_budget: read each part in slices of whole rows of at most
                `budget.chunk_bytes` bytes, straight into the target's array (a
                device's shard made on the device first), instead of whole.

        Raises:
            CheckpointError: `rename` given.
            DamagedCheckpointError: the file cannot be read whole.
        """
        if rename is not None:
            raise CheckpointError(
                f"{self.directory}: a local step restores only into the model it was saved from; read renamed "
                "paths from the persistent tier."
            )
        meta = self.read_meta(step) if meta is None else meta
        if template is None:
            template = self.stored_tree(step, with_optimizer)
        where = self.directory / str(step) / ARRAYS
        stored: Mapping[str, Any] = meta["arrays"]
        flat: dict[str, Any] = {}
        try:
            with PartsFile(where, meta["bytes"]) as parts:  # only the parts the template needs are read
                for path, target in wanted(template, with_optimizer).items():
                    entry = stored[path]
                    shape = tuple(entry["shape"])
                    sharding = getattr(target, "sharding", None)
                    if sharding is None:
                        whole = [[0, size] for size in shape]
                        if host_memory_budget.bounded:
                            flat[path] = parts.sliced(entry, whole, host_memory_budget, None)
                        else:
                            flat[path] = np.array(parts.values(entry, whole))
                        continue
                    indices = sharding.addressable_devices_indices_map(shape)
                    if host_memory_budget.bounded:
                        arrays = [
                            parts.sliced(entry, index_of(at, shape), host_memory_budget, device)
                            for device, at in indices.items()
                        ]
                    else:
                        arrays = [
                            jax.device_put(parts.values(entry, index_of(at, shape)), device, may_alias=False)
                            for device, at in indices.items()
                        ]
                    flat[path] = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
        except OSError as error:
            raise DamagedCheckpointError(f"{where} cannot be read ({error}): the step is damaged") from error
        return StoredCheckpoint(state_dict=state_dict_of(flat), meta=dict(meta))
