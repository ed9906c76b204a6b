"""A save's and a restore's host memory under a budget (`host_memory_budget=` on writers and readers).

orbax writes an array as one tensorstore chunk and reads it whole: a save of
a host array holds a copy of it and tensorstore's buffers (about 2x the
array with chunks), and a restore holds the array it read before it is put
on the devices; a read of a slice of a one-chunk array decodes the whole
chunk (benchmarks/RESULTS.md, issue 60). With a budget B, each array is
stored in chunks of at most B/8 and 4 MiB (`HostMemoryBudget.chunk_bytes`),
in orbax's own format (any orbax reader reads it), and written and read
chunk by chunk, `HostMemoryBudget.slots` chunks in flight in a process, each held at most `COPIES` times:
a save references the record's host copy (read-only, which nothing donates)
and holds only the chunks being encoded; a restore makes each device's
shard on the device and writes each chunk it reads into it. Neither holds
more than B beyond the state's own copies, whatever the size of the largest
array, and an allowance that does not grow with the state
(`flaxstate.host_memory.BUDGET_ALLOWANCE`).

Arrays saved from the devices (`record_memory="device"`, or a state saved as
it is) are written the same way, each process its own shards (replica 0), a
chunk at a time sliced on its device and copied to host memory alone, where
orbax would copy each shard whole: orbax's format again, without its
per-process file of write shapes (as its `ArrayHandler(array_metadata_store=
None)`).

A checkpoint written without a budget holds each array as one chunk, and a
tensorstore read of any slice of a chunk decodes the whole of it (its file's
bytes and the decoded array: twice the array at its peak). orbax stores
chunks uncompressed (zarr's `"compressor": null`, or zarr3's lone `bytes`
codec), so such a chunk is its array's bytes in C order: a restore reads it
in byte ranges of whole rows of at most `chunk_bytes` (`RawChunks`), within
the budget again. orbax's own bound (`restore_concurrent_gb`, its
`LimitInFlightBytes`) refuses a read of one chunk larger than the limit
("Requested more bytes than we reserved space for"), so it cannot serve
here. Only a compressed chunk larger than the budget's is decoded whole
(the reader logs which), and then read straight into its shard, never
beside a shard already made (twice the array at most, as without a budget).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from flaxstate import private_apis, settings

logger = logging.getLogger("flaxstate")

SLOTS = 2
"""Chunks in flight at once in a process, at the least (a larger budget lets more fly: `slots`)."""
MOST_SLOTS = 8
"""Chunks in flight at most, whatever the budget: a save of a 256 MiB state took 1.5 s with 2 and 0.8 s with 16,
and a restore 0.76 s and 0.72 s, while each chunk in flight leaves its buffers in a thread's malloc arena (a
restore with 16 held 195 MiB beyond the state, more than one without a budget)."""
COPIES = 4
"""How many times a chunk in flight is held at most: a restore holds its file's bytes, their decoding, the read
array and its copy on the device; a save, fewer."""
MINIMUM = COPIES * SLOTS * 4096
"""The smallest budget: a page-sized chunk."""
LARGEST_CHUNK = 4 * 2**20
"""The largest chunk stored, whatever the budget. glibc's malloc serves a block below its mmap threshold (which
rises to 32 MiB as large blocks are freed) from the arena of the thread that asks, and keeps it there once freed:
tensorstore's threads each keep about a chunk. At 8 MiB chunks a restore's peak was 1.6x a 64 MiB budget; at
4 MiB, within it (benchmarks/RESULTS.md)."""

Region = tuple[slice, ...]
PRIMARY_HOST = 0
"""The process that creates each array's metadata and the sharding file (orbax's primary host)."""


@dataclasses.dataclass(frozen=True)
class HostMemoryBudget:
    """Bytes that a save, a peer exchange or a restore may hold in host memory beyond the state, however large
    its largest array (see the module); `HostMemoryBudget()`: no bound.

    One object for every place that a budget bounds: a writer's saves and its peer copies, a reader's restores
    and the tiers' reads, the S3 store's chunks, and `fs.plan`'s figures; each takes it, or the int it is made
    of (`host_memory_budget=16 * 2**20` is `HostMemoryBudget(16 * 2**20)`), and all check it here. A door's
    `host_memory_budget=None` is the unbounded budget (`UNBOUNDED`): orbax's own writes and reads, each array
    one chunk, held whole.

    Args:
        bytes: the budget, at least `MINIMUM` (32 KiB: a page-sized chunk, `COPIES` x `SLOTS` of them), or
            `None` for no bound.

    Raises:
        ValueError: `bytes` neither `None` nor an int, or below `MINIMUM`.
    """

    bytes: int | None = None

    def __post_init__(self) -> None:
        if self.bytes is not None:
            checked = settings.count("HostMemoryBudget", "bytes", self.bytes, minimum=MINIMUM)
            object.__setattr__(self, "bytes", checked)

    @property
    def bounded(self) -> bool:
        """Whether it bounds anything (`bytes` given)."""
        return self.bytes is not None

    @property
    def chunk_bytes(self) -> int:
        """The largest chunk the budget stores, reads or moves: `bytes / (COPIES SLOTS)`, at most
        `LARGEST_CHUNK` (which an unbounded budget's streams move at once)."""
        if self.bytes is None:
            return LARGEST_CHUNK
        return min(self.bytes // (COPIES * SLOTS), LARGEST_CHUNK)

    @property
    def block_bytes(self) -> int | None:
        """The largest block an array is stored or packed in: `chunk_bytes`, or `None` (the array whole) without
        a bound."""
        return self.chunk_bytes if self.bounded else None

    @property
    def slots(self) -> int:
        """How many chunks the budget lets fly at once in a process (each held at most `COPIES` times), at most
        `MOST_SLOTS`."""
        if self.bytes is None:
            return MOST_SLOTS
        return min(self.bytes // (COPIES * self.chunk_bytes), MOST_SLOTS)

    def holds(self, size: int, allowance: int) -> int:
        """The most that a task which holds `size` bytes without a bound holds under the budget, and `allowance`
        (what does not grow with the state)."""
        return size if self.bytes is None else min(size, self.bytes + allowance)

    def handler_options(self) -> dict[str, Any]:
        """orbax's `PyTreeCheckpointHandler` keywords: its default type handlers, with host and device arrays
        written and read within the budget where it bounds (`registry`); none without a bound."""
        return {"type_handler_registry": _registry(self)} if self.bounded else {}

    def registry(self) -> Any:
        """orbax's default type handlers, with host and device arrays written and read within the budget."""
        return _registry(self)


UNBOUNDED = HostMemoryBudget()
"""No bound: what a door's `host_memory_budget=None` means."""


def of(value: HostMemoryBudget | int | None, owner: str) -> HostMemoryBudget:
    """A door's `host_memory_budget=`, checked once: `None` (`UNBOUNDED`), a `HostMemoryBudget`, or its bytes.

    Raises:
        ValueError: an int that is not at least `MINIMUM`, or anything else.
    """
    if value is None:
        return UNBOUNDED
    if isinstance(value, HostMemoryBudget):
        return value
    return HostMemoryBudget(settings.count(owner, "host_memory_budget", value, minimum=MINIMUM))


def chunks(shape: Sequence[int], chunk_shape: Sequence[int], within: Region | None = None) -> Iterator[Region]:
    """The regions of a chunk grid (`chunk_shape`) that meet `within` (the whole array by default), clipped to it."""
    if within is None:
        within = tuple(slice(0, size) for size in shape)
    starts = [
        range((part.start // step) * step, part.stop, step) for part, step in zip(within, chunk_shape, strict=True)
    ]
    for corner in itertools.product(*starts):
        yield tuple(
            slice(max(start, part.start), min(start + step, part.stop))
            for start, step, part in zip(corner, chunk_shape, within, strict=True)
        )


def _chunked(args: Sequence[Any] | None, n: int, budget: HostMemoryBudget) -> list[Any]:
    """orbax's save arguments of `n` arrays, each stored in chunks of at most the budget's `chunk_bytes`."""
    return [dataclasses.replace(arg, chunk_byte_size=budget.chunk_bytes) for arg in (args or [ocp.SaveArgs()] * n)]


class Slots:
    """At most the budget's `slots` chunks in flight in a process, whichever thread's event loop runs them (orbax
    saves and restores a step's items on loops of their own)."""

    def __init__(self, budget: HostMemoryBudget) -> None:
        self.budget = budget
        self.size = budget.slots
        self._free = threading.BoundedSemaphore(self.size)

    def try_acquire(self) -> bool:
        return self._free.acquire(blocking=False)

    async def acquire(self) -> None:
        """Waits for a slot (call it holding none: a holder that waits could wait on itself)."""
        while not self.try_acquire():
            await asyncio.sleep(0.001)

    def release(self) -> None:
        self._free.release()

    @contextlib.asynccontextmanager
    async def __call__(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()


async def _each(regions: Iterator[Region], slots: Slots, work: Any) -> None:
    """Runs `work(region)` for every region, as many at once as the slots allow."""

    async def one(region: Region) -> None:
        async with slots():
            await work(region)

    await asyncio.gather(*(one(region) for region in regions))


def region_of(index: tuple[slice, ...], shape: Sequence[int]) -> Region:
    """A shard's index (slices that may be open) as the region of the array it covers."""
    return tuple(slice(*part.indices(size)[:2]) for part, size in zip(index, shape, strict=True))


def _chunk_shape(store: ts.TensorStore) -> tuple[int, ...]:
    """The shape of a store's chunks (a scalar's: its own, `()`)."""
    shape = store.chunk_layout.read_chunk.shape
    sizes: Sequence[Any] = store.shape if shape is None else shape
    return tuple(int(size) for size in sizes)


def _stored_chunk_bytes(store: ts.TensorStore) -> int:
    return math.prod(_chunk_shape(store)) * store.dtype.numpy_dtype.itemsize


@dataclasses.dataclass(frozen=True)
class RawChunks:
    """Where a stored array's chunks are its bytes as they are (uncompressed, C order, little-endian): the key of
    each chunk in the array's key-value store, so that any run of whole rows of a chunk is one byte-range read."""

    kvstore: Any
    """The array's own key-value store (`TensorStore.kvstore`, its path the array's)."""
    chunk_shape: tuple[int, ...]
    dtype: np.dtype
    separator: str
    prefix: str
    """zarr3's default keys are `c/0/0`; zarr's (and zarr3's `v2` encoding) are `0.0`."""

    @classmethod
    def of(cls, store: ts.TensorStore) -> RawChunks | None:
        """The raw chunks of `store` (as opened, not cast), or `None` where a chunk must be decoded (a compressor,
        a filter, Fortran order, big-endian data, or a driver that is not zarr's)."""
        try:
            spec = store.spec().to_json()
            kvstore = store.kvstore
        except (AttributeError, ValueError):
            return None
        metadata, dtype = spec.get("metadata", {}), store.dtype.numpy_dtype
        if kvstore is None or dtype.byteorder == ">" or (dtype.byteorder == "=" and np.little_endian is False):
            return None
        if spec.get("driver") == "zarr":
            if metadata.get("compressor") is not None or metadata.get("filters") is not None:
                return None
            if metadata.get("order", "C") != "C" or str(metadata.get("dtype", "<"))[0] == ">":
                return None
            return cls(kvstore, _chunk_shape(store), dtype, metadata.get("dimension_separator", "."), "")
        if spec.get("driver") == "zarr3":
            codecs = metadata.get("codecs", [])
            if len(codecs) != 1 or codecs[0].get("name") != "bytes":
                return None
            if codecs[0].get("configuration", {}).get("endian", "little") != "little":
                return None
            encoding = metadata.get("chunk_key_encoding", {"name": "default"})
            separator = encoding.get("configuration", {}).get("separator")
            if encoding.get("name") == "v2":
                return cls(kvstore, _chunk_shape(store), dtype, separator or ".", "")
            return cls(kvstore, _chunk_shape(store), dtype, separator or "/", "c" + (separator or "/"))
        return None

    def key(self, chunk: Sequence[int]) -> bytes:
        return (
            self.prefix + self.separator.join(str(index) for index in chunk) if chunk else self.prefix + "0"
        ).encode()

    async def read(self, region: Region, most_bytes: int) -> np.ndarray | None:
        """The stored values of `region` (within one chunk), read in byte ranges of whole rows of at most
        `most_bytes` (one element at the least); `None` where the chunk is not stored (its fill value: read it
        through tensorstore)."""
        chunk = tuple(part.start // size for part, size in zip(region, self.chunk_shape, strict=True))
        local = tuple(
            slice(part.start - index * size, part.stop - index * size)
            for part, index, size in zip(region, chunk, self.chunk_shape, strict=True)
        )
        out = np.empty(tuple(part.stop - part.start for part in region), self.dtype)
        most = max(1, most_bytes // self.dtype.itemsize)
        for offset, shape, take, at in _row_runs(self.chunk_shape, local, most):
            size = math.prod(shape) * self.dtype.itemsize
            start = offset * self.dtype.itemsize
            result = await self.kvstore.read(self.key(chunk), byte_range=slice(start, start + size))
            if result.state != "value":
                return None
            out[at] = np.frombuffer(result.value, self.dtype).reshape(shape)[take]
            del result
        return out


def _row_runs(
    chunk_shape: Sequence[int], region: Region, most: int
) -> Iterator[tuple[int, tuple[int, ...], Region, Region]]:
    """Contiguous runs of a C-order chunk that cover `region` (local to the chunk), each at most `most` elements
    (one element at the least): `(first element, shape read, the part of it in region, where that goes in the
    region's array)`. A run is whole rows of the chunk (its trailing axes whole) where a row fits, and is split
    along the next axis where it does not."""
    if not chunk_shape:
        yield 0, (), (), ()
        return
    row = math.prod(chunk_shape[1:])
    first, rest = region[0], tuple(region[1:])
    whole_rest = tuple(slice(0, part.stop - part.start) for part in rest)
    if row <= most:
        step = max(1, most // row)
        for start in range(first.start, first.stop, step):
            stop = min(start + step, first.stop)
            at = (slice(start - first.start, stop - first.start), *whole_rest)
            yield start * row, (stop - start, *chunk_shape[1:]), (slice(None), *rest), at
        return
    for index in range(first.start, first.stop):
        for offset, shape, take, at in _row_runs(chunk_shape[1:], rest, most):
            yield (
                index * row + offset,
                (1, *shape),
                (slice(None), *take),
                (slice(index - first.start, index - first.start + 1), *at),
            )


class Reading:
    """A stored array read within a budget: chunks no larger than the budget's read as tensorstore reads them;
    larger ones in byte ranges where they are raw (`RawChunks`), or decoded whole where they are not."""

    def __init__(self, store: ts.TensorStore, budget: HostMemoryBudget, name: str, dtype: Any = None) -> None:
        self.store = store
        self.name = name
        self.dtype = np.dtype(store.dtype.numpy_dtype if dtype is None else dtype)
        self.most_bytes = budget.chunk_bytes
        self.large = _stored_chunk_bytes(store) > self.most_bytes
        self.raw = RawChunks.of(store) if self.large else None
        self.whole = self.large and self.raw is None
        """Chunks that must be decoded whole: each region is read at once and put on its device whole."""
        if self.whole:
            logger.warning(
                "%s is stored in compressed chunks of %d bytes, more than the budget's %d: each is decoded whole "
                "(twice the chunk in host memory at its peak); save with host_memory_budget= to read it in bounded "
                "slices.",
                name,
                _stored_chunk_bytes(store),
                self.most_bytes,
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(size) for size in self.store.shape)

    @property
    def grid(self) -> tuple[int, ...]:
        return _chunk_shape(self.store)

    def pieces(self, within: Region) -> Iterator[Region]:
        """The regions that cover `within`, each read at once: the stored chunks it meets, and where those are
        larger than the budget's and raw, the runs of whole rows of them that fit it (`_row_runs`)."""
        for region in chunks(self.shape, self.grid, within):
            if self.raw is None:
                yield region
                continue
            corner = tuple(part.start // size * size for part, size in zip(region, self.grid, strict=True))
            local = tuple(slice(part.start - at, part.stop - at) for part, at in zip(region, corner, strict=True))
            most = max(1, self.most_bytes // max(self.dtype.itemsize, self.raw.dtype.itemsize))
            for _, _, _, at in _row_runs(self.grid, local, most):
                yield tuple(
                    slice(part.start + cut.start, part.start + cut.stop) for part, cut in zip(region, at, strict=True)
                )

    async def read(self, region: Region) -> np.ndarray:
        """The values of `region` (one of `pieces`, or any region where chunks are decoded whole)."""
        if self.raw is not None:
            values = await self.raw.read(region, self.most_bytes)
            if values is not None:
                return values if values.dtype == self.dtype else values.astype(self.dtype)
        values = await self.store[region].read()
        return values if values.dtype == self.dtype else values.astype(self.dtype)


class NumpyHandler(ocp.type_handlers.NumpyHandler):
    """orbax's handler of host (numpy) arrays, writing and reading chunk by chunk within a budget."""

    def __init__(self, budget: HostMemoryBudget, slots: Slots) -> None:
        super().__init__(deepcopy_host_arrays=False)  # records are read-only host copies: referenced, not copied
        self._budget = budget
        self._slots = slots

    async def serialize(
        self,
        values: Sequence[np.ndarray],
        infos: Sequence[Any],
        args: Sequence[Any] | None = None,
    ) -> Any:
        return await super().serialize(values, infos, _chunked(args, len(values), self._budget))

    async def _open_and_write(self, value: np.ndarray, tspec: dict[str, Any], ts_context: ts.Context) -> None:
        store = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
        await write_host(store, np.asarray(value), self._slots)

    async def deserialize(self, infos: Sequence[Any], args: Sequence[Any] | None = None) -> list[np.ndarray]:
        args = args or [ocp.RestoreArgs()] * len(infos)
        return [await _read_host(info, arg, self._budget, self._slots) for info, arg in zip(infos, args, strict=True)]


def _read_context(budget: HostMemoryBudget) -> ts.Context:
    """orbax's tensorstore context for reads, with OCDBT's cache (orbax's: 100 MB) bounded to one chunk."""
    spec = ocp.type_handlers.get_ts_context(use_ocdbt=True).spec.to_json()
    spec["cache_pool#ocdbt"] = {"total_bytes_limit": budget.chunk_bytes}
    return ts.Context(ts.Context.Spec(spec))


async def _open_read(info: Any, arg: Any, budget: HostMemoryBudget) -> Reading:
    await info.await_path_creation()
    spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=info.is_ocdbt_checkpoint)
    store = await ts.open(ts.Spec(spec), open=True, context=_read_context(budget))
    return Reading(store, budget, info.name, getattr(arg, "dtype", None))


async def _read_host(info: Any, arg: Any, budget: HostMemoryBudget, slots: Slots) -> np.ndarray:
    """One array of an orbax item read into a numpy array, chunk by chunk."""
    return await read_host(await _open_read(info, arg, budget), slots)


async def write_host(store: ts.TensorStore, value: np.ndarray, slots: Slots) -> None:
    """Writes a host array into `store` (opened), a chunk at a time, referenced where it is (not copied first)."""

    async def write(region: Region) -> None:
        await store[region].write(value[region], can_reference_source_data_indefinitely=True)

    await _each(chunks(value.shape, _chunk_shape(store)), slots, write)


async def write_shard(store: ts.TensorStore, data: jax.Array, region: Region, slots: Slots) -> None:
    """Writes one device shard (`data`, at the global `region`) into `store`, a chunk at a time copied from its
    device alone."""

    async def write(piece_region: Region) -> None:
        start = tuple(cut.start - part.start for cut, part in zip(piece_region, region, strict=True))
        size = tuple(cut.stop - cut.start for cut in piece_region)
        piece = await asyncio.to_thread(on_host, data, start, size)
        await store[piece_region].write(piece, can_reference_source_data_indefinitely=True)

    await _each(chunks(store.shape, _chunk_shape(store), region), slots, write)


async def read_host(reading: Reading, slots: Slots) -> np.ndarray:
    """A whole stored array read into a numpy array, chunk by chunk (a chunk decoded whole: the array at once)."""
    if reading.whole:
        async with slots():
            return await reading.read(tuple(slice(0, size) for size in reading.shape))
    out = np.empty(reading.shape, dtype=reading.dtype)

    async def read(region: Region) -> None:
        out[region] = await reading.read(region)

    await _each(reading.pieces(tuple(slice(0, size) for size in out.shape)), slots, read)
    return out


async def read_shards(reading: Reading, sharding: jax.sharding.Sharding, slots: Slots) -> jax.Array:
    """A stored array read onto this process's devices under `sharding`: each shard made on its device and
    filled with the chunks it covers, as they are read (where a chunk must be decoded whole, the shard is read
    at once and put on its device: no shard is made beside it)."""
    shape, dtype = reading.shape, reading.dtype
    shards = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        assert index is not None  # a device of the sharding holds a part
        region = region_of(index, shape)
        if reading.whole:
            async with slots():
                shards.append(jax.device_put(await reading.read(region), device).block_until_ready())
            continue
        shard = jax.numpy.zeros(tuple(part.stop - part.start for part in region), dtype, device=device)
        reads: collections.deque[tuple[tuple[int, ...], Any]] = collections.deque()
        try:
            for piece_region in reading.pieces(region):
                # A chunk read holds a slot until its copy on the device is in the shard. Where none is free,
                # the oldest read goes into the shard first; holding none, this waits for another thread's.
                while reads and not slots.try_acquire():
                    start, read = reads.popleft()
                    shard = put(shard, await read, start)
                    slots.release()
                if not reads:
                    await slots.acquire()
                start = tuple(cut.start - part.start for cut, part in zip(piece_region, region, strict=True))
                reads.append((start, asyncio.ensure_future(reading.read(piece_region))))
            while reads:
                start, read = reads.popleft()
                shard = put(shard, await read, start)
                slots.release()
        finally:
            for _, read in reads:  # a failed read: the slots of those still pending
                read.cancel()
                slots.release()
        shards.append(shard)
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


@functools.partial(jax.jit, donate_argnums=0)
def _put(shard: jax.Array, piece: jax.Array, start: tuple[jax.Array, ...]) -> jax.Array:
    return jax.lax.dynamic_update_slice(shard, piece, start)


@functools.partial(jax.jit, static_argnums=2)
def _take(data: jax.Array, start: tuple[jax.Array, ...], size: tuple[int, ...]) -> jax.Array:
    return jax.lax.dynamic_slice(data, start, size)


def on_host(data: jax.Array, start: Sequence[int], size: tuple[int, ...]) -> np.ndarray:
    """The region of a device array `data` at `start` of `size`, copied to host memory alone (not the whole array).

    One compiled slice serves every region of a size (the chunks of a shard but its edges).
    """
    piece = data if size == data.shape else _take(data, tuple(np.int32(s) for s in start), size)
    return np.asarray(piece)


def put(shard: jax.Array, piece: np.ndarray, start: Sequence[int]) -> jax.Array:
    """`shard` (donated) with a host piece written at `start`, on the shard's device; waits, so that the piece's
    copy on the device is freed before the next is read."""
    (device,) = shard.devices()
    return _put(shard, jax.device_put(piece, device), tuple(start)).block_until_ready()


class ArrayHandler(ocp.type_handlers.TypeHandler):
    """orbax's handler of device arrays (`inner`), reading each shard chunk by chunk on its device within a budget.

    Saves, metadata and restores of anything but a sharded array of the stored shape stay `inner`'s.
    """

    def __init__(self, budget: HostMemoryBudget, inner: Any, slots: Slots) -> None:
        self._budget = budget
        self._inner = inner
        self._slots = slots
        self._array_metadata_store = None
        """No per-process file of write shapes, as orbax's `ArrayHandler(array_metadata_store=None)`: orbax reads
        this attribute of the registry's handler to write and check that file, which only `inner`'s saves write."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def typestr(self) -> str:
        return str(self._inner.typestr())

    async def metadata(self, infos: Sequence[Any]) -> Any:
        return await self._inner.metadata(infos)

    async def serialize(self, values: Sequence[Any], infos: Sequence[Any], args: Sequence[Any] | None = None) -> Any:
        args = _chunked(args, len(values), self._budget)
        keys = [jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key) for value in values]
        futures = []
        if any(keys):  # random keys carry their implementation in orbax's metadata: its own save (a few bytes)
            theirs = [[items[i] for i, key in enumerate(keys) if key] for items in (values, infos, args)]
            futures.extend(await self._inner.serialize(*theirs))
        ours = [[items[i] for i, key in enumerate(keys) if not key] for items in (values, infos, args)]
        if ours[0]:
            futures.append(ocp.future.CommitFutureAwaitingContractedSignals(self._write(*ours), name="budget"))
        return futures

    async def _write(self, values: Sequence[jax.Array], infos: Sequence[Any], args: Sequence[Any]) -> None:
        """Writes each array's shards that this process owns (replica 0), chunk by chunk from the devices, and
        orbax's sharding file."""
        writes = [self._write_shards(value, info, arg) for value, info, arg in zip(values, infos, args, strict=True)]
        shardings = private_apis.orbax_sharding_file_writer()
        if shardings is not None:
            writes.append(shardings([value.sharding for value in values], infos, primary_host=PRIMARY_HOST))
        await asyncio.gather(*writes)

    async def _write_shards(self, value: jax.Array, info: Any, arg: Any) -> None:
        await info.await_path_creation()
        spec = ocp.type_handlers.get_json_tspec_write(
            info,
            use_ocdbt=info.is_ocdbt_checkpoint,
            global_shape=value.shape,
            local_shape=value.addressable_shards[0].data.shape,
            dtype=value.dtype,
            process_index=jax.process_index() if info.is_ocdbt_checkpoint else None,
            arg=arg,
        )
        if jax.process_index() == PRIMARY_HOST:  # the array's metadata; the others' writes assume it
            await ts.open(ts.Spec(spec), create=True, open=True, context=info.ts_context)
        store = await ts.open(ts.Spec(spec), open=True, assume_metadata=True, context=info.ts_context)
        for shard in value.addressable_shards:
            if shard.replica_id == 0:
                await write_shard(store, shard.data, region_of(shard.index, value.shape), self._slots)

    async def deserialize(self, infos: Sequence[Any], args: Sequence[Any] | None = None) -> list[Any]:
        if args is None or any(getattr(arg, "sharding", None) is None for arg in args):
            return list(await self._inner.deserialize(infos, args))
        return [await self._read(info, arg) for info, arg in zip(infos, args, strict=True)]

    async def _read(self, info: Any, arg: Any) -> jax.Array:
        reading = await _open_read(info, arg, self._budget)
        if arg.global_shape is not None and tuple(arg.global_shape) != reading.shape:
            return (await self._inner.deserialize([info], [arg]))[0]  # orbax pads or truncates: its own read
        return await read_shards(reading, arg.sharding, self._slots)


def _registry(budget: HostMemoryBudget) -> Any:
    """orbax's default type handlers, with host and device arrays written and read within `budget`."""
    slots = Slots(budget)  # one process's chunks in flight, host and device arrays together
    own = {
        np.ndarray: NumpyHandler(budget, slots),
        jax.Array: ArrayHandler(budget, ocp.type_handlers.get_type_handler(jax.Array), slots),
    }
    kinds = ocp.type_handlers.supported_types()
    return ocp.type_handlers.create_type_handler_registry(
        *((kind, own.get(kind) or ocp.type_handlers.get_type_handler(kind)) for kind in kinds)
    )
