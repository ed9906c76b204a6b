"""A local step's files: `arrays.bin` and `meta.json` in `<step>/`, written into `<step>.partial-<pid>` and renamed
into place (see `flaxstate.checkpoint.stores.local`, the store that keeps them, and
`flaxstate.checkpoint.tiers.peers`, which writes a peer's copies in the same format).

- `pack_step`: a step's meta and `arrays.bin`'s bytes as chunks (this process's distinct parts, 64-byte aligned);
- `write_packed`, or `open_partial` then `place_partial`: a step written, fsync'd and renamed into place;
- `step_numbers`, `stored_meta`, `run_of`, `remove_step`: a directory's complete steps, read and removed;
- `PartsFile`: a step's `arrays.bin`, read a stored part at a time.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from flaxstate.checkpoint import budget
from flaxstate.checkpoint.damage import DamagedCheckpointError
from flaxstate.checkpoint.stores.lifecycle import RenameIntoPlace, beyond_keep
from flaxstate.checkpoint.stores.parts import DevicePart, Index, contains, host_parts

ARRAYS, META_FILE = "arrays.bin", "meta.json"
PARTIAL = ".partial-"
"""What a save in progress (or one killed) holds in its directory's name: `<step>.partial-<pid>`."""

STEPS = RenameIntoPlace(PARTIAL)
"""A local step is complete once renamed into place."""

ALIGN = 64
"""The alignment of each part's bytes in `arrays.bin`."""
Chunk = np.ndarray | DevicePart
"""A run of `arrays.bin`'s bytes: a numpy view, or a part on a device (read a block at a time)."""


def fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def pack_step(
    flat: Mapping[str, Any], header: dict[str, Any], block_bytes: int | None = None
) -> tuple[dict[str, Any], list[Chunk]]:
    """A step's meta and `arrays.bin`'s bytes as chunks (no copy): this process's distinct parts, 64-byte aligned.

    With `block_bytes` (a budget's), a part on a device stays there, a `DevicePart` read a block at a time.
    """
    arrays: dict[str, Any] = {}
    chunks: list[Chunk] = []
    offset = 0
    for path, value in flat.items():
        shape, dtype, parts = host_parts(value, block_bytes)
        entries = []
        for index, data in parts:
            padding = -offset % ALIGN
            chunks.append(np.zeros(padding, np.uint8))
            offset += padding
            if isinstance(data, np.ndarray):
                data = np.ascontiguousarray(data)
                chunks.append(data.reshape(-1).view(np.uint8))
            else:
                chunks.append(data)
            entries.append({"index": index, "offset": offset})
            offset += data.nbytes
        arrays[path] = {"shape": list(shape), "dtype": dtype.name, "parts": entries}
    return {**header, "arrays": arrays, "bytes": offset}, chunks


def write_packed(directory: Path, step: int, meta: Mapping[str, Any], chunks: list[Chunk], keep: int | None) -> None:
    """Writes a step into `<step>.partial-<pid>`, fsync'd, renames it into place, drops the oldest beyond `keep`.

    A `DevicePart` is written a block at a time, as it is read from its device.
    """
    partial = open_partial(directory, step)
    with open(partial / ARRAYS, "wb") as file:
        for chunk in chunks:
            if isinstance(chunk, DevicePart):
                for begin in range(0, chunk.nbytes, chunk.block_bytes):
                    file.write(chunk.read(begin, min(begin + chunk.block_bytes, chunk.nbytes)).data)
                continue
            file.write(chunk.data if chunk.size else b"")
        file.flush()
        os.fsync(file.fileno())
    place_partial(directory, step, meta, keep)


def open_partial(directory: Path, step: int) -> Path:
    """A fresh `<step>.partial-<pid>` in `directory` (one this process left is removed), for `arrays.bin`."""
    directory.mkdir(parents=True, exist_ok=True)
    partial = _partial(directory, step)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def _partial(directory: Path, step: int) -> Path:
    """Where this process writes `step` before naming it: `<step>.partial-<pid>`."""
    return directory / f"{step}{PARTIAL}{os.getpid()}"


def place_partial(directory: Path, step: int, meta: Mapping[str, Any], keep: int | None) -> None:
    """Writes `meta.json` beside the `arrays.bin` of `open_partial`'s directory (written and fsync'd), renames it
    into place, and drops the oldest steps beyond `keep`."""
    partial = _partial(directory, step)
    with open(partial / META_FILE, "w") as file:
        json.dump(meta, file)
        file.flush()
        os.fsync(file.fileno())
    fsync_directory(partial)
    os.rename(partial, directory / str(step))
    fsync_directory(directory)
    if keep is not None:
        for old in beyond_keep(step_numbers(directory), keep):
            remove_step(directory, old)


def stored_meta(step_dir: Path) -> dict[str, Any]:
    """A step's `meta.json` as stored (not checked: `LocalStore.read_meta` checks it against the format)."""
    meta: dict[str, Any] = json.loads((step_dir / META_FILE).read_text())
    return meta


def run_of(step_dir: Path) -> str | None:
    """A step's run id (`None` where its meta does not read)."""
    try:
        return stored_meta(step_dir).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def remove_step(directory: Path, step: int) -> None:
    """Removes a step: renamed out of the listing first, so that no reader meets it half deleted."""
    STEPS.delete(directory / str(step))


def step_numbers(directory: Path) -> list[int]:
    """The complete steps of a directory of local steps (a process's, or its copies of a peer's), oldest first."""
    return STEPS.complete(directory)


class PartsFile:
    """A step's arrays file, read a stored part at a time (each once), as the template asks for them.

    Read, not mapped: JAX's CPU client would alias a mapping's read-only
    pages, which a step donates.
    """

    def __init__(self, path: Path, size: int) -> None:
        self._path = path
        self._size = size
        self._file = open(path, "rb")  # noqa: SIM115  closed by __exit__
        self._read: dict[int, np.ndarray] = {}

    def __enter__(self) -> PartsFile:
        if os.fstat(self._file.fileno()).st_size != self._size:
            self._file.close()
            raise DamagedCheckpointError(f"{self._path} changed while it was read: the step is damaged")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._file.close()

    def sliced(
        self, entry: Mapping[str, Any], index: Index, host_memory_budget: budget.HostMemoryBudget, device: Any
    ) -> Any:
        """The values at `index` of a stored array, read in slices of whole rows of its stored part (at most
        `budget.chunk_bytes`, and one row) into a numpy array, or with a `device` into an array made there."""
        dtype = np.dtype(jnp.dtype(entry["dtype"]))
        outer = next(part for part in entry["parts"] if contains(part["index"], index))  # covers() checked
        outer_shape = [stop - start for start, stop in outer["index"]]
        shape = tuple(stop - start for start, stop in index)
        out: Any = np.empty(shape, dtype) if device is None else jnp.zeros(shape, dtype, device=device)
        if not shape:
            piece = self._bytes(int(outer["offset"]), dtype.itemsize).view(dtype).reshape(())
            return piece.copy() if device is None else budget.put(out, piece, ())
        row_bytes = math.prod(outer_shape[1:]) * dtype.itemsize
        rows = max(1, host_memory_budget.chunk_bytes // max(1, row_bytes))
        (first, last), (outer_first, _) = index[0], outer["index"][0]
        inner = tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(index[1:], outer["index"][1:], strict=True))
        for start in range(first, last, rows):
            stop = min(start + rows, last)
            at = int(outer["offset"]) + (start - outer_first) * row_bytes
            data = self._bytes(at, (stop - start) * row_bytes).view(dtype).reshape(stop - start, *outer_shape[1:])
            piece = data[(slice(None), *inner)]
            if device is None:
                out[start - first : stop - first] = piece
            else:
                out = budget.put(out, piece, (start - first,) + (0,) * len(inner))
        return out

    def _bytes(self, offset: int, size: int) -> np.ndarray:
        """`size` bytes of the file from `offset`, read (not kept)."""
        data = np.empty(size, dtype=np.uint8)
        self._file.seek(offset)
        if self._file.readinto(data.data) != size:
            raise DamagedCheckpointError(f"{self._path} ends inside an array's part: the step is damaged")
        return data

    def values(self, entry: Mapping[str, Any], index: Index) -> np.ndarray:
        """The values at `index` of a stored array, from a stored part that contains it (a view of that part)."""
        dtype = jnp.dtype(entry["dtype"])
        outer = next(part for part in entry["parts"] if contains(part["index"], index))  # covers() checked
        shape = [stop - start for start, stop in outer["index"]]
        begin = int(outer["offset"])
        if begin not in self._read:
            self._read[begin] = self._bytes(begin, math.prod(shape) * dtype.itemsize)
        data = self._read[begin].view(dtype).reshape(shape)
        return data[tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(index, outer["index"], strict=True))]
