"""Where the parts of an array sit: the places a process holds, the places it needs, and whether a step covers them.

A part is named by its place in its global array (`Index`: `[start, stop]`
of each dimension). The local tier (`flaxstate.checkpoint.stores.local`)
writes each distinct part this process holds once; a restart asks `covers`
whether a step holds every part that this process's devices need under the
template's shardings, and the peer copies (`flaxstate.checkpoint.tiers.peers`)
fingerprint `held_parts` and `needed_parts` to match owners with copies.
No data is read here but a shard's own.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from flaxstate import tree_paths

Index = list[list[int]]
"""A part's place in its global array: `[start, stop]` of each dimension."""

T = TypeVar("T")


def index_of(where: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    """The place of a shard's slices in an array of `shape`, as `[start, stop]` of each dimension."""
    return [list(part.indices(size)[:2]) for part, size in zip(where, shape, strict=True)]


def held_parts(flat: Mapping[str, Any]) -> dict[str, list[Index]]:
    """Where each distinct part that this process holds sits in its global array, by path (no data is read)."""
    held: dict[str, list[Index]] = {}
    for path, value in flat.items():
        if isinstance(value, jax.Array):
            held[path] = [index for index, _ in distinct_shards(value)]
        else:
            held[path] = [[[0, size] for size in np.shape(value)]]
    return held


class DevicePart:
    """A shard on its device, read into host memory a block of at most `block_bytes` at a time (never whole).

    Its bytes are the shard's in C order, as `np.asarray(shard).tobytes()`. One
    compiled slice serves every block of a shard (the last block is read as the
    last `block_bytes`), and the newest block is kept for the next read.
    """

    def __init__(self, data: jax.Array, block_bytes: int) -> None:
        self.data = data
        self.nbytes = int(data.nbytes)
        self._itemsize = np.dtype(data.dtype).itemsize
        self._count = int(data.size)
        self._block = max(1, min(block_bytes // self._itemsize, self._count))
        self.block_bytes = self._block * self._itemsize
        """The bytes of a block (at most the `block_bytes` asked, and one element)."""
        self._held: tuple[int, np.ndarray] | None = None

    def _elements(self, first: int) -> np.ndarray:
        """Elements `first` to `first + block` (clipped at the end) as bytes, from the device."""
        if self._held is None or self._held[0] != first:
            start = min(first, self._count - self._block)  # dynamic_slice clamps there too: say it
            flat = np.asarray(_block_of(self.data, np.int32(start), self._block)).view(np.uint8)
            self._held = first, flat[(first - start) * self._itemsize :]
        return self._held[1]

    def read(self, begin: int, end: int) -> np.ndarray:
        """Bytes `begin` to `end` (a uint8 row)."""
        pieces = []
        while begin < end:
            first = begin // self.block_bytes * self._block
            held = self._elements(first)
            offset = begin - first * self._itemsize
            piece = held[offset : offset + end - begin]
            if not piece.size:
                raise ValueError(f"bytes {begin:,} to {end:,} of a part of {self.nbytes:,} bytes were read")
            pieces.append(piece)
            begin += piece.size
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


@functools.partial(jax.jit, static_argnums=2)
def _block_of(data: jax.Array, start: jax.Array, size: int) -> jax.Array:
    return jax.lax.dynamic_slice(data.reshape(-1), (start,), (size,))


def host_parts(
    value: Any, block_bytes: int | None = None
) -> tuple[tuple[int, ...], np.dtype, list[tuple[Index, np.ndarray | DevicePart]]]:
    """An array's global shape, dtype and the distinct parts this process holds, as numpy.

    A numpy array (the host copy of a replicated array) is one part, the
    whole; a `jax.Array` gives its addressable shards, each place once: as
    numpy, or (with `block_bytes`) each a `DevicePart` read a block at a time.
    """
    if isinstance(value, jax.Array):
        parts: list[tuple[Index, np.ndarray | DevicePart]] = [
            (index, np.asarray(shard.data) if block_bytes is None else DevicePart(shard.data, block_bytes))
            for index, shard in distinct_shards(value)
        ]
        return tuple(value.shape), np.dtype(value.dtype), parts
    array = np.asarray(value)
    return array.shape, array.dtype, [([[0, size] for size in array.shape], array)]


def distinct(indexed: Iterable[tuple[Index, T]]) -> list[tuple[Index, T]]:
    """Each index once, with its first item, in an order that every process shares (the order of its JSON)."""
    first: dict[str, tuple[Index, T]] = {}
    for index, item in indexed:
        first.setdefault(json.dumps(index), (index, item))
    return [first[key] for key in sorted(first)]


def distinct_shards(value: jax.Array) -> list[tuple[Index, Any]]:
    """This process's shards of an array, each place once, with where they sit in the global array."""
    return distinct((index_of(shard.index, value.shape), shard) for shard in value.addressable_shards)


def contains(outer: Index, inner: Index) -> bool:
    """Whether the part at `outer` holds the part at `inner`."""
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def covers(meta: Mapping[str, Any], template: Mapping[str, Any], with_optimizer: bool) -> str | None:
    """Why a step cannot restore into `template` on this process (`None`: it can).

    It can when it holds the template's paths, shapes and dtypes, and
    for every device of this process the part of each array that the
    template's sharding places there.
    """
    if meta.get("processes") != jax.process_count() or meta.get("process_index") != jax.process_index():
        return (
            f"it was saved by process {meta.get('process_index')} of {meta.get('processes')}, "
            f"this is process {jax.process_index()} of {jax.process_count()}"
        )
    stored: Mapping[str, Any] = meta["arrays"]
    for path, target in wanted(template, with_optimizer).items():
        entry = stored.get(path)
        if entry is None:
            return f"it holds no array at {path}"
        shape, dtype = tuple(target.shape), np.dtype(target.dtype)
        if tuple(entry["shape"]) != shape or jnp.dtype(entry["dtype"]) != dtype:
            return f"{path} is {entry['dtype']}{entry['shape']} there, the model has {dtype.name}{list(shape)}"
        for index in needed(target):
            if not any(contains(part["index"], index) for part in entry["parts"]):
                return f"it holds no part {index} of {path}, which this process's devices need (another mesh)"
    return None


def needed_parts(template: Mapping[str, Any], with_optimizer: bool) -> dict[str, list[Index]]:
    """The distinct parts of each array that this process's devices hold under the template's shardings, by path."""
    return {
        path: [index for index, _ in distinct((index, None) for index in needed(target))]
        for path, target in wanted(template, with_optimizer).items()
    }


def wanted(template: Mapping[str, Any], with_optimizer: bool) -> dict[str, Any]:
    flat = tree_paths.flatten(dict(template))
    return {path: leaf for path, leaf in flat.items() if with_optimizer or not path.startswith("state/")}


def needed(target: Any) -> list[Index]:
    """The parts of an array that this process's devices hold under the template's sharding (all: no sharding)."""
    shape = tuple(target.shape)
    sharding = getattr(target, "sharding", None)
    if sharding is None:
        return [[[0, size] for size in shape]]
    return [index_of(where, shape) for where in sharding.addressable_devices_indices_map(shape).values()]
