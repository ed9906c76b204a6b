"""Fingerprints of a training state and of the batches trained: what a resume's replay is checked against.

A record carries two (`Checkpoint.state_fingerprint`, `Checkpoint.data_fingerprint`),
each 16 hex digits, and the goodput ledger keeps them with its step
(`flaxstate.run_record.audit` compares those of a replay with the earlier sessions').

- The state's: every leaf's bits as 32-bit words, each mixed with its global
  place (the leaf's offset in the state plus its flat index; in the second
  lane, its shape and dtype too), summed modulo 2^32 in two lanes. Integer
  sums are exact in any order, so the fingerprint is the same on any mesh and
  any number of processes, and one compiled program computes it on the
  devices from the loop's own arrays (no host copy): a reduction of the
  state, whose result is 8 bytes, once a record. A loop's record of K > 1
  steps a dispatch computes it inside that dispatch's own program, after the
  steps (`flaxstate.training.step.update_program`); a record of one step, by
  `of_state`. A single changed bit of any element changes the first lane.
- The data's: where the data is `fs.global_batches`, the source indices of
  every global batch trained since the previous record (the same on any
  process count: nothing is read); else a digest of the bytes of the first
  batch trained since the previous record, leaf by leaf (`BatchDigest` of
  `first_of` the span's first dispatch; several processes' are combined in
  process order, by the record's one gather). A resume starts at a record,
  so a data position restored wrong shows at the first batch it replays;
  reading one batch a record, not each, keeps the steps between records free
  of the digest (on a host that waits for each small step, as this project's
  CPUs do, any reading at a dispatch adds to the step).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

ENABLED = True
"""Whether loops fingerprint their records (`benchmarks/loop_overhead.py` turns it off to measure what they cost)."""
_ODD = np.uint32(0x9E3779B1)
"""A multiplier of the second lane (the 32-bit golden ratio, odd)."""
_MIX = np.uint32(0x85EBCA6B)
"""MurmurHash3's finalizer constant: mixes a word with its place in the second lane."""


def _words(leaf: jax.Array) -> jax.Array:
    """A leaf's bits as uint32 words (one a element; two for a 64-bit one; a bool or a narrower type widened).

    A key array comes as its `jax.random.key_data` (`_lanes` takes it so, before grouping the small leaves).
    """
    if leaf.dtype == jnp.bool_:
        return leaf.astype(jnp.uint32)
    width = np.dtype(leaf.dtype).itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[width]
    bits = jax.lax.bitcast_convert_type(leaf, unsigned)  # 8 bytes: a last axis of two words
    return bits.astype(jnp.uint32)


_SMALL = 4096
"""A leaf of at most this many elements is summed with the others of its dtype, concatenated (below)."""
_GROUP = 1 << 16
"""The most words in one concatenation of small leaves (its places are a constant of the program)."""


def _sums(words: jax.Array, place: jax.Array, layout: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The two lanes' sums of some words at their places, in one pass (a reduction of two outputs)."""
    first = words * (place * jnp.uint32(2) + jnp.uint32(1))
    mixed = (words ^ ((place + layout) * _ODD)) * _MIX
    second = mixed ^ (mixed >> 15)
    zero = jnp.uint32(0)
    every = tuple(range(words.ndim))
    return jax.lax.reduce((first, second), (zero, zero), lambda a, b: (a[0] + b[0], a[1] + b[1]), every)


def _typed_sharding(leaf: jax.Array) -> bool:
    """Whether a leaf's type carries its sharding (an axis of an Explicit mesh, `jax.make_mesh`'s default): such
    a leaf cannot be flattened without naming the flat array's sharding (JAX's `ShardingTypeError`)."""
    return any(axis is not None for axis in jax.typeof(leaf).sharding.spec)


def _places(words: jax.Array, offset: int) -> jax.Array:
    """Each word's place (`offset` plus its flat index, modulo 2^32) in the words' own shape and sharding: what
    `arange` over the flattened words gives, for words that stay sharded as they are."""
    sharding = jax.typeof(words).sharding
    place = jnp.uint32(offset % 2**32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        index = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis, out_sharding=sharding)
        place = place + index * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    return place


def _layout(leaf: jax.Array) -> np.uint32:
    return np.uint32(zlib.crc32(f"{leaf.shape}{leaf.dtype}".encode()))  # a reshaped leaf differs


def _chunk_sums(chunk: Sequence[tuple[jax.Array, int, np.uint32]]) -> tuple[jax.Array, jax.Array]:
    """The two lanes' sums of small leaves of one dtype, concatenated (each with its offset and layout)."""
    words = _words(jnp.concatenate([leaf.reshape(-1) for leaf, _, _ in chunk])).reshape(-1)
    per = words.size // sum(leaf.size for leaf, _, _ in chunk)  # words an element: 2 for an 8-byte dtype
    place = np.concatenate([np.arange(at, at + leaf.size * per, dtype=np.uint64) for leaf, at, _ in chunk])
    layout = np.concatenate([np.full(leaf.size * per, code, np.uint32) for leaf, _, code in chunk])
    return _sums(words, jnp.asarray((place % 2**32).astype(np.uint32)), jnp.asarray(layout))


@jax.jit
def _lanes(leaves: Sequence[jax.Array]) -> jax.Array:
    # One reduction a large leaf; the small ones concatenated by dtype, so that a state of many small leaves
    # is a few kernels (XLA's CPU runtime spends 2-3 us a kernel: 20 leaves took 70 us as 40 sums, 15 us so).
    first = second = jnp.uint32(0)
    groups: dict[Any, list[tuple[jax.Array, int, np.uint32]]] = {}
    offset = 0
    for leaf in leaves:
        layout = _layout(leaf)
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        words = _words(leaf)
        if 0 < leaf.size <= _SMALL:
            if _typed_sharding(leaf):  # gathered: a few KiB, concatenated with the others
                leaf = jax.sharding.reshard(leaf, jax.typeof(leaf).sharding.update(spec=jax.sharding.PartitionSpec()))
            groups.setdefault(leaf.dtype, []).append((leaf, offset, layout))
        elif leaf.size and _typed_sharding(words):  # summed where its shards are, in its own shape
            lanes = _sums(words, _places(words, offset), jnp.uint32(layout))
            first, second = first + lanes[0], second + lanes[1]
        elif leaf.size:
            place = jnp.arange(words.size, dtype=jnp.uint32) + jnp.uint32(offset % 2**32)
            lanes = _sums(words.reshape(-1), place, jnp.uint32(layout))
            first, second = first + lanes[0], second + lanes[1]
        offset += words.size
    for members in groups.values():
        chunk: list[tuple[jax.Array, int, np.uint32]] = []
        size = 0  # the chunk's elements
        for number, member in enumerate(members):
            chunk.append(member)
            size += member[0].size
            if number + 1 == len(members) or size + members[number + 1][0].size > _GROUP:
                lanes = _chunk_sums(chunk)
                first, second = first + lanes[0], second + lanes[1]
                chunk, size = [], 0
    return jnp.stack([first, second])


def of_state(leaves: Sequence[jax.Array]) -> jax.Array:
    """The state's fingerprint as two uint32 on the devices (dispatched, not waited for): `text` reads it.

    Args:
        leaves: the state's arrays (global arrays of every process: a collective of a few bytes).
    """
    return _lanes(list(leaves))


def text(lanes: Any) -> str:
    """A fingerprint's 16 hex digits (waits for the devices)."""
    first, second = np.asarray(lanes, dtype=np.uint32).tolist()  # 1 us; `jax.device_get`'s tree walk took 8 us
    return f"{first:08x}{second:08x}"


_LARGE = 1 << 14
"""A batch's leaf of at least this many bytes (a multiple of 8) is summed, not CRC'd (`_weighted`)."""
_CHUNK = 1 << 17
"""Words a pass of `_weighted` (its weights: 1 MiB)."""
_GOLDEN = 0x9E3779B97F4A7C15
"""The 64-bit golden ratio, odd: the weights' multiplier."""
_WEIGHTS = (np.arange(_CHUNK, dtype=np.uint64) * np.uint64(2) + np.uint64(1)) * np.uint64(_GOLDEN)
_MASK = 2**64 - 1


def _weighted(words: np.ndarray) -> int:
    """The sum of 64-bit words, each times an odd weight of its place, modulo 2^64 (numpy at memory speed).

    A changed word changes it (an odd weight has an inverse), as does one
    moved. Four times quicker than zlib's CRC: 48 against 189 us for a batch
    of 0.8 MB not in the caches (`benchmarks/fingerprints.py`).
    """
    total = 0
    for start in range(0, words.size, _CHUNK):  # the place (2 i + 1) G, i = start + j: a chunk's weights and
        chunk = words[start : start + _CHUNK]  # 2 start G times its plain sum
        total += int((chunk * _WEIGHTS[: chunk.size]).sum(dtype=np.uint64))
        if start:
            total += 2 * start * _GOLDEN * int(chunk.sum(dtype=np.uint64))
    return total & _MASK


def first_of(batch: tuple[tuple[Any, ...], tuple[Any, ...]], n_batches: int) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The first of the `n_batches` batches stacked in a dispatch's batch, `(inputs, targets)`: a view of each host
    leaf's first row (a leaf on the devices is kept as it is, and not read)."""
    if n_batches == 1:
        return batch
    inputs, targets = (tuple(_first_row(leaf) for leaf in part) for part in batch)
    return inputs, targets


def _first_row(leaf: Any) -> Any:
    """A host leaf's first row; a whole batch (NNX's `loss_fn(model, batch)`: a dict, a tuple) leaf by leaf."""
    if isinstance(leaf, np.ndarray):
        return leaf[0]
    if isinstance(leaf, jax.Array):
        return leaf
    return jax.tree.map(lambda each: each[0] if isinstance(each, np.ndarray) else each, leaf)


def _array_leaves(part: tuple[Any, ...]) -> Any:
    """A batch part's arrays: the part itself, or the leaves of a whole batch it holds (a dict, a tuple of arrays)."""
    for leaf in part:
        if not isinstance(leaf, np.ndarray | jax.Array):
            return jax.tree.leaves(part)
    return part


class BatchDigest:
    """Digests of the batches trained since it was last `taken`, one a leaf of the batch, batch after batch.

    A leaf's digest runs over its batches in order, so K batches stacked for
    one dispatch give what the K batches give one by one. The loop adds the
    first batch of each span between records (`first_of` its dispatch), in
    its thread, while the devices run it. A batch's leaf of under `_LARGE` bytes goes through
    zlib's CRC-32 (about 0.3 us a call); a larger one is summed with weights
    (`_weighted`), whose 8 bytes go through the CRC. A batch whose leaves
    are on the devices already (JAX arrays) is not read: the digest is then
    unknown (`None`).
    """

    def __init__(self) -> None:
        self._crcs: list[int] = []
        self._unknown = False

    def add(self, batch: tuple[tuple[Any, ...], tuple[Any, ...]], n_batches: int = 1) -> None:
        """Adds one dispatch's batch, `(inputs, targets)` (`flaxstate.training.batching.normalize`'s form; a whole
        batch, NNX's, is digested leaf by leaf).

        Args:
            n_batches: the batches stacked in it, on each leaf's first axis (K of a dispatch of K steps).
        """
        crcs = self._crcs
        index = 0
        for part in batch:  # in the loop's thread at every dispatch: 0.8 us for two small leaves (a byte view of
            for leaf in _array_leaves(part):  # each took 1.3 us, and numpy gives none of bfloat16's): their buffers
                if index == len(crcs):
                    crcs.append(0)
                if isinstance(leaf, jax.Array):
                    self._unknown = True
                else:
                    if type(leaf) is not np.ndarray or not leaf.flags.c_contiguous:
                        leaf = np.ascontiguousarray(leaf)
                    each = leaf.nbytes // n_batches
                    if each < _LARGE or each % 8:
                        crcs[index] = zlib.crc32(cast(Any, leaf), crcs[index])  # any dtype: no format asked
                    else:
                        words = leaf.reshape(-1).view(np.uint8).view(np.uint64).reshape(n_batches, -1)
                        for row in words:
                            crcs[index] = zlib.crc32(_weighted(row).to_bytes(8, "little"), crcs[index])
                index += 1

    def take(self) -> int | None:
        """The digest of the batches added since the last `take` (then starts again); `None` where unknown."""
        crcs, unknown = self._crcs, self._unknown
        self._crcs, self._unknown = [], False
        if unknown:
            return None
        return zlib.crc32(b"".join(crc.to_bytes(4, "little") for crc in crcs), len(crcs))


def of_indices(indices: Sequence[np.ndarray]) -> str:
    """The fingerprint of global batches by their source indices, in order (16 hex digits)."""
    crc = first = 0
    for batch in indices:
        data = np.ascontiguousarray(batch, dtype=np.int64).view(np.uint8).data
        crc = zlib.crc32(data, crc)
        first = zlib.adler32(data, first)
    return f"{crc:08x}{first:08x}"


def of_digests(digests: Sequence[int | None]) -> str | None:
    """The fingerprint of every process's `BatchDigest`, in process order (16 hex digits; `None` where one is
    unknown)."""
    if any(digest is None for digest in digests):
        return None
    known = [int(digest) for digest in digests if digest is not None]
    crc = functools.reduce(lambda total, each: zlib.crc32(each.to_bytes(4, "little"), total), known, 0)
    return f"{crc:08x}{len(known):08x}"
