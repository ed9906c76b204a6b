"""The store of an s3:// run directory: every process's arrays through tensorstore's s3 driver, metadata through s3fs.

orbax 0.12.8 writes arrays only to local paths and `gs://` (its tensorstore
specs are built inside it, for those two), so an `s3://` run directory is a
store of its own. A step is `<run>/<step>/`:

- `arrays/<n>/`: array n of the state dict, a zarr3 array written by
  tensorstore's s3 driver. A sharded array is written by every process, each
  its own shards once (JAX's `array_serialization`, as orbax does);
  an array whole on each process (numpy, or a fully addressable array) by the
  primary process alone;
- `done-<index>`: written by each process once its shards are in the bucket;
- `meta.json`: the record's meta, each array's path, shape and dtype, and
  the size of every object under `arrays/` (written by the primary once every
  process is done);
- `commit_success.txt`, written last, as orbax commits a `gs://` step: a step
  without it is unfinished, never listed, and removed by the next writer.

A step whose objects are missing or not the size its meta names is damaged
(zarr would read a missing chunk as zeros). A step deleted while it is read
is `VanishedStepError`. Restores read only the parts of each array that the
template's sharding places on this process's devices, on any mesh and any
number of processes.

The tensorstore spec names the endpoint of `AWS_ENDPOINT_URL_S3` or
`AWS_ENDPOINT_URL` and the region of `AWS_REGION` or `AWS_DEFAULT_REGION`,
where set: tensorstore's s3 driver does not read the endpoint's variable
itself. Credentials are the AWS variables or files, read by both clients.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from jax.experimental import multihost_utils
from jax.experimental.array_serialization import serialization

from flaxstate import background, locations, tree_paths
from flaxstate.checkpoint import budget, saving, steps
from flaxstate.checkpoint import meta as meta_format
from flaxstate.checkpoint.best import BestPolicy
from flaxstate.checkpoint.budget import UNBOUNDED, HostMemoryBudget
from flaxstate.checkpoint.damage import DamagedCheckpointError
from flaxstate.checkpoint.errors import CheckpointError, CheckpointSaveError
from flaxstate.checkpoint.layout import SET_ASIDE, Rename, StoredCheckpoint, renamed_against, state_dict_of, to_json
from flaxstate.checkpoint.saving import Metrics, Tree
from flaxstate.checkpoint.steps import VanishedStepError
from flaxstate.checkpoint.stores.lifecycle import CommitMarker, beyond_keep
from flaxstate.records import FORMAT_VERSION

COMMIT, META_FILE, ARRAYS, DONE = "commit_success.txt", "meta.json", "arrays", "done-"
STEPS = CommitMarker(COMMIT)
"""An s3:// step is complete once the primary wrote its commit marker, last."""

DONE_SECONDS = 600.0
"""How long the primary process waits for the other processes' parts of a save before the save fails."""


def kvstore(url: str) -> dict[str, Any]:
    """tensorstore's s3 kvstore spec of `s3://bucket/key/`, with the endpoint and region of the AWS variables."""
    bucket, _, key = url.removeprefix("s3://").partition("/")
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key.strip("/") + "/"}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    return spec


def _array_spec(step_dir: Path, number: int) -> dict[str, Any]:
    return {"driver": "zarr3", "kvstore": kvstore(f"{step_dir}/{ARRAYS}/{number}")}


class ObjectStore(saving.SaveSlot):
    """The steps of an `s3://` run directory (see the module): save, list, check, read.

    Args:
        directory: the run directory's URL, as `locations.run_directory` gives it.
        keep: how many steps to keep (the newest, or with `best`, the best).
        best: keep the best by a metric instead of the newest.
        read_only: open for reading; nothing is created.
        host_memory_budget: bytes a save or a restore may hold beyond the state: each array is stored in
            chunks of at most `budget.chunk_bytes` (a sharded one's dividing its shards), written and read a
            chunk at a time (`flaxstate.checkpoint.budget`); `None`, whole shards and arrays.
    """

    shared = True
    """Every process writes this one directory together: only the primary process changes it."""

    def __init__(
        self,
        directory: str | Path,
        keep: int | None = None,
        best: BestPolicy | None = None,
        read_only: bool = False,
        host_memory_budget: HostMemoryBudget = UNBOUNDED,
    ) -> None:
        super().__init__()
        self.directory = locations.as_path(directory)
        self._slots = budget.Slots(host_memory_budget) if host_memory_budget.bounded else None
        """The budget's chunks in flight (`None`: no budget)."""
        self._keep = keep
        self._best = best
        self._listed: set[int] = set()
        """The steps of the last listing and of this store's own saves: `save` checks them with no request."""
        self._checked: dict[int, dict[str, Any]] = {}
        """The newest step whose meta and objects were checked (a committed step never changes)."""
        if not read_only:
            background.track(self)

    # Writing.

    def _holds(self, step: int) -> bool:
        return step in self._listed  # no request here: the loop must not wait on the bucket

    def _start(self, step: int, state_dict: Tree, meta: Tree, metrics: Metrics, *, saved: bool) -> None:
        """This process's parts, in the background; the primary commits the step."""
        if saved:
            raise self.refuse_replacing(step)
        flat = tree_paths.flatten(dict(state_dict))
        header = {**to_json(dict(meta)), "format_version": FORMAT_VERSION, "time": time.time()}
        if jax.process_count() > 1:
            # No process writes into <step>/ before the primary's claim has removed unfinished saves' folders
            # (it would take another process's save in progress for one). orbax's save syncs likewise.
            multihost_utils.sync_global_devices(f"flaxstate: the s3:// save of step {step}")
        self._pending = saving.BackgroundSave(step, lambda: self._write(step, flat, header))

    def _write(self, step: int, flat: Mapping[str, Any], header: dict[str, Any]) -> None:
        step_dir = self.directory / str(step)
        primary = jax.process_index() == 0
        locations.forget_listings(step_dir)
        if (step_dir / COMMIT).exists():
            raise self.refuse_replacing(step)
        shards, wholes = [], []
        for number, value in enumerate(flat.values()):
            if isinstance(value, jax.Array) and not value.is_fully_addressable:
                shards.append((value, _array_spec(step_dir, number)))
            elif primary and self._slots is not None and isinstance(value, jax.Array):
                shards.append((value, _array_spec(step_dir, number)))  # from its devices, a chunk at a time
            elif primary:
                wholes.append((np.asarray(value), _array_spec(step_dir, number)))
        if self._slots is None:
            asyncio.run(_write_arrays(shards, wholes))
        else:
            asyncio.run(_write_bounded(shards, wholes, self._slots.budget.chunk_bytes, self._slots))
        (step_dir / f"{DONE}{jax.process_index()}").write_text("")
        if not primary:
            return
        _wait_for_processes(step_dir)
        listing = locations.tree_listing(step_dir / ARRAYS)
        arrays = {
            path: {"number": number, "shape": list(np.shape(value)), "dtype": jnp.dtype(value.dtype).name}
            for number, (path, value) in enumerate(flat.items())
        }
        (step_dir / META_FILE).write_text(json.dumps({**header, "arrays": arrays, "objects": listing}))
        (step_dir / COMMIT).write_text("")
        self._listed.add(step)
        self._rotate()

    def _rotate(self) -> None:
        """Deletes the steps beyond `keep`: the oldest, or with `best`, the worst by the metric."""
        best = self._best
        rank = (lambda step: best.rank(self._metrics_of(step))) if best is not None else None
        self.delete(beyond_keep(self.steps(), self._keep, rank), waiting=False)

    def _metrics_of(self, step: int) -> Mapping[str, Any]:
        try:
            return self.read_meta(step).get("metrics") or {}
        except CheckpointError:
            return {}

    def unfinished(self) -> list[Path]:
        """The folders of saves that did not finish (or are running): `<step>/` without `commit_success.txt`."""
        return STEPS.unfinished(self.directory)

    def remove_unfinished(self, step: int | None = None) -> list[Path]:
        """Removes what saves that did not finish left (on the primary process)."""
        if jax.process_index() != 0:
            return []
        return saving.remove_until_quiet(lambda: STEPS.unfinished(self.directory, step))

    def set_aside(self, step: int, suffix: str = SET_ASIDE) -> Path:
        """Moves a step out of the listing (`<step><suffix>`) by copy, marker delete, delete; returns the new path."""
        self.wait()
        self._forget(step)
        return STEPS.set_aside(self.directory / str(step), suffix)

    def _forget(self, step: int) -> None:
        """Drops what this store remembers of a step that leaves the listing."""
        self._listed.discard(step)
        self._checked.pop(step, None)

    def delete(self, steps: list[int], *, waiting: bool = True) -> None:
        """Removes whole steps: the commit marker first, so that no reader takes one half deleted."""
        if waiting:
            self.wait()
        for step in steps:
            self._forget(step)
            STEPS.delete(self.directory / str(step))

    # Reading.

    def steps(self) -> list[int]:
        """The committed steps, oldest first."""
        found = STEPS.complete(self.directory)
        self._listed = set(found)
        return found

    def read_meta(self, step: int) -> dict[str, Any]:
        """Returns a step's meta, checked against the format and against its objects' sizes.

        Raises:
            DamagedCheckpointError: its meta is missing, not JSON or not valid,
                or an object under `arrays/` is missing or not the size it names.
            CheckpointError: written by a newer flaxstate.
            VanishedStepError: the step was deleted meanwhile.
        """
        if step in self._checked:
            return self._checked[step]
        step_dir = self.directory / str(step)
        meta = steps.reading(step_dir, lambda: _read_meta(step_dir))
        self._checked = {step: meta}
        return meta

    def stored_tree(self, step: int, with_optimizer: bool = True) -> dict[str, Any]:
        """Returns a step's state-dict layout with `jax.ShapeDtypeStruct`s as leaves (no array read)."""
        return state_dict_of(_structs(self.read_meta(step), with_optimizer))

    def read_paths(self, step: int, paths: list[str]) -> dict[str, np.ndarray]:
        """Reads some whole arrays of a step by their state-dict paths, as numpy, and no other.

        Raises:
            CheckpointError: a path the step does not hold.
        """
        meta = self.read_meta(step)
        missing = sorted(set(paths) - set(meta["arrays"]))
        if missing:
            raise CheckpointError(f"{self.directory / str(step)} holds no array at {', '.join(missing)}.")
        step_dir = self.directory / str(step)
        numbers = [meta["arrays"][path]["number"] for path in paths]
        read = steps.reading(
            step_dir, lambda: dict(zip(paths, _read_wholes(step_dir, numbers, self._slots), strict=True))
        )
        _check_committed(step_dir)
        return read

    def read(
        self, step: int, template: Mapping[str, Any] | None, *, with_optimizer: bool = True, rename: Rename = None
    ) -> StoredCheckpoint:
        """Restores a step into a template state dict's tree and shardings (`None`: numpy arrays of the stored tree).

        Raises:
            StateMismatchError: the (renamed) stored tree differs from the template's.
        """
        meta = self.read_meta(step)
        stored = _structs(meta, with_optimizer)
        step_dir = self.directory / str(step)
        new_path, expected = renamed_against(
            stored, template, rename, with_optimizer, f"the checkpoint of step {step} in {self.directory}"
        )

        def read() -> dict[str, Any]:
            wholes, sharded = {}, []
            for path, new in new_path.items():
                number = meta["arrays"][path]["number"]
                sharding = getattr(expected.get(new), "sharding", None)
                if sharding is None:
                    wholes[new] = number
                else:
                    sharded.append((new, sharding, _array_spec(step_dir, number), stored[path]))
            flat: dict[str, Any] = dict(
                zip(wholes, _read_wholes(step_dir, list(wholes.values()), self._slots), strict=True)
            )
            if sharded and self._slots is not None:
                specs = [(new, sharding, spec) for new, sharding, spec, _ in sharded]
                arrays = asyncio.run(_read_bounded(specs, self._slots))
                flat.update({new: array for (new, *_), array in zip(sharded, arrays, strict=True)})
            elif sharded:
                arrays = serialization.run_deserialization(
                    [sharding for _, sharding, _, _ in sharded],
                    [spec for _, _, spec, _ in sharded],
                    [struct.shape for *_, struct in sharded],
                    [struct.dtype for *_, struct in sharded],
                )
                flat.update({new: array for (new, *_), array in zip(sharded, arrays, strict=True)})
            return flat

        flat = steps.reading(step_dir, read)
        _check_committed(step_dir)
        return StoredCheckpoint(state_dict=state_dict_of(flat), meta=meta)


async def _write_arrays(shards: list[tuple[jax.Array, dict[str, Any]]], wholes: list[tuple[np.ndarray, dict]]) -> None:
    """Writes this process's shards of sharded arrays (each shard once) and, on the primary, the whole arrays."""

    async def whole(value: np.ndarray, spec: dict[str, Any]) -> None:
        metadata = {"shape": list(value.shape), "data_type": value.dtype.name, "chunk_grid": _chunks(value.shape)}
        array = await ts.open({**spec, "metadata": metadata}, create=True)
        await array.write(value)

    await asyncio.gather(
        *(serialization.async_serialize(value, spec, primary_host=0, replica_id=0) for value, spec in shards),
        *(whole(value, spec) for value, spec in wholes),
    )


async def _write_bounded(
    shards: list[tuple[jax.Array, dict[str, Any]]],
    wholes: list[tuple[np.ndarray, dict]],
    most: int,
    slots: budget.Slots,
) -> None:
    """`_write_arrays` within a budget: arrays in chunks of at most `most` bytes, a chunk at a time in host memory
    (a device shard's sliced on its device)."""

    async def whole(value: np.ndarray, spec: dict[str, Any]) -> None:
        grid = _chunks(value.shape, max(1, most // value.dtype.itemsize))
        metadata = {"shape": list(value.shape), "data_type": value.dtype.name, "chunk_grid": grid}
        await budget.write_host(await ts.open({**spec, "metadata": metadata}, create=True), value, slots)

    async def sharded(value: jax.Array, spec: dict[str, Any]) -> None:
        shard_shape = value.addressable_shards[0].data.shape
        grid = _dividing_chunks(shard_shape, max(1, most // value.dtype.itemsize))
        dtype = jnp.dtype(value.dtype).name
        spec = {**spec, "metadata": {"shape": list(value.shape), "data_type": dtype, "chunk_grid": grid}}
        if jax.process_index() == 0:  # the array's metadata; the others' writes assume it, as JAX's serialization
            await ts.open(spec, create=True, open=True)
        store = await ts.open(spec, open=True, assume_metadata=True)
        for shard in value.addressable_shards:
            if shard.replica_id == 0:
                await budget.write_shard(store, shard.data, budget.region_of(shard.index, value.shape), slots)

    await asyncio.gather(
        *(sharded(value, spec) for value, spec in shards), *(whole(value, spec) for value, spec in wholes)
    )


async def _read_bounded(
    specs: list[tuple[str, jax.sharding.Sharding, dict[str, Any]]], slots: budget.Slots
) -> list[jax.Array]:
    """Arrays read onto this process's devices, each shard filled a stored chunk at a time."""
    arrays = []
    for name, sharding, spec in specs:
        store = await ts.open(spec, open=True)
        arrays.append(await budget.read_shards(budget.Reading(store, slots.budget, name), sharding, slots))
    return arrays


CHUNK_ELEMENTS = 100_000_000
"""At most this many elements an object of an array written whole (JAX's serialization's own chunk bound)."""


def _chunks(shape: tuple[int, ...], most: int = CHUNK_ELEMENTS) -> dict[str, Any]:
    """zarr3's regular grid for an array written whole: chunks of at most `most` elements (where one element is
    not more), whole rows of the first axes where they fit, few objects."""
    chunk = [max(1, size) for size in shape]
    for axis in range(len(chunk)):
        inner = math.prod(chunk[axis + 1 :])
        chunk[axis] = max(1, min(chunk[axis], most // max(1, inner)))
    return {"name": "regular", "configuration": {"chunk_shape": chunk}}


def _dividing_chunks(shard_shape: tuple[int, ...], most: int) -> dict[str, Any]:
    """zarr3's regular grid for a sharded array: chunks that divide its shards (no two processes write one
    chunk), of at most `most` elements where a divisor allows."""
    chunk = [max(1, size) for size in shard_shape]
    for axis in range(len(chunk)):
        inner = math.prod(chunk[axis + 1 :])
        limit = max(1, most // max(1, inner))
        chunk[axis] = _largest_divisor(chunk[axis], limit)
    return {"name": "regular", "configuration": {"chunk_shape": chunk}}


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of `n` not above `at_most` (1 at least)."""
    divisors = {d for small in range(1, math.isqrt(n) + 1) if n % small == 0 for d in (small, n // small)}
    return max(d for d in divisors if d <= at_most) if at_most >= 1 else 1


def _wait_for_processes(step_dir: Path) -> None:
    """Waits (on the primary) until every process has written its `done-<index>` for the step.

    Raises:
        CheckpointSaveError: some process's parts did not arrive in `DONE_SECONDS`.
    """
    wanted = {f"{DONE}{index}" for index in range(jax.process_count())}
    deadline = time.monotonic() + DONE_SECONDS
    while True:
        locations.forget_listings(step_dir)
        missing = wanted - {path.name for path in step_dir.iterdir()}
        if not missing:
            return
        if time.monotonic() > deadline:
            raise CheckpointSaveError(
                f"{step_dir}: processes {sorted(missing)} did not finish their parts in {DONE_SECONDS:.0f} s."
            )
        time.sleep(0.1)


def _read_meta(step_dir: Path) -> dict[str, Any]:
    where = step_dir / META_FILE
    try:
        meta = meta_format.read(where, step_dir)
    except FileNotFoundError as error:
        raise DamagedCheckpointError(f"{where} is missing: the step is damaged") from error
    if not isinstance(meta.get("arrays"), Mapping) or not isinstance(meta.get("objects"), Mapping):
        raise DamagedCheckpointError(f"{where} names no arrays: the step is damaged")
    found = locations.tree_listing(step_dir / ARRAYS)
    for name, size in meta["objects"].items():
        if found.get(name) != size:
            _check_committed(step_dir)
            what = "is missing" if name not in found else f"holds {found[name]:,} bytes where its meta names {size:,}"
            raise DamagedCheckpointError(f"{step_dir / ARRAYS / name} {what}: the step is damaged")
    return meta


def _structs(meta: Mapping[str, Any], with_optimizer: bool) -> dict[str, jax.ShapeDtypeStruct]:
    """A step's arrays by state-dict path, as shapes and dtypes (the optimizer's left out without `with_optimizer`)."""
    return {
        path: jax.ShapeDtypeStruct(tuple(entry["shape"]), jnp.dtype(entry["dtype"]))
        for path, entry in meta["arrays"].items()
        if with_optimizer or not path.startswith("state/")
    }


def _check_committed(step_dir: Path) -> None:
    """Raises `VanishedStepError` when a step's commit marker is gone: a writer is deleting it (marker first).

    zarr reads a chunk that is gone as its fill value, so a read is trusted only if the marker outlived it.
    """
    locations.forget_listings(step_dir)
    if not (step_dir / COMMIT).exists():
        raise VanishedStepError(f"{step_dir} was deleted while it was read.")


def _read_wholes(step_dir: Path, numbers: list[int], slots: budget.Slots | None = None) -> list[np.ndarray]:
    """Whole arrays of a step, as numpy, read concurrently (with `slots`, a budget's chunks at a time)."""
    if slots is not None:

        async def bounded() -> list[np.ndarray]:
            stored = []
            for number in numbers:
                store = await ts.open(_array_spec(step_dir, number), open=True)
                reading = budget.Reading(store, slots.budget, f"{step_dir / ARRAYS}/{number}")
                stored.append(await budget.read_host(reading, slots))
            return stored

        return asyncio.run(bounded())
    opening = [ts.open(_array_spec(step_dir, number), open=True) for number in numbers]
    reading = [opened.result().read() for opened in opening]
    return [np.asarray(read.result()) for read in reading]


def is_object_store(directory: Path) -> bool:
    """Whether `directory` is written by `ObjectStore` (an `s3://` URL) rather than by orbax."""
    return locations.scheme_of(directory) == "s3"


__all__ = ["ObjectStore", "VanishedStepError", "is_object_store", "kvstore"]
