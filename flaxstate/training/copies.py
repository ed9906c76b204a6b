"""The copies of the loop's arrays that its records hold: in host memory, or in device memory.

The loop donates its state at every dispatch, so a record needs a copy that
nothing donates. In device memory, that copy, the record's gradients and a
record still held (by the caller, or by a background save) while the next is
made took a run to 4.3 copies of the state on the devices. In host memory the
devices hold one copy: a record holds numpy arrays, which every JAX and numpy
function takes (`model.apply` included) and which nothing can donate, delete
or change (they are read-only).

The copy is staged as orbax stages a save on a GPU, in the host memory kind of
each array's sharding (an asynchronous device-to-host transfer, which JAX
orders before the next dispatch overwrites the donated buffers): by one
compiled identity whose outputs live there where all leaves share a device set
(a replicated state's one replica), else by `jax.device_put`; then a numpy
view of that host buffer, which waits for the transfer. A numpy view of the
*device* buffer (`np.asarray` of the state itself) would be no copy on a CPU,
and the next dispatch could then not donate that buffer: XLA would silently
allocate the state anew.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, Sharding

PyTree = Any
HOST, DEVICE = "host", "device"
RECORD_MEMORIES = (HOST, DEVICE)
_HOST_KINDS = ("pinned_host", "unpinned_host")
"""Host memory kinds, preferred first: pinned memory is what a device copies to at full speed."""


def host_memory_kind(mesh: Mesh) -> str | None:
    """The host memory kind that every local device of `mesh` has, or `None` (a platform without one)."""
    local = [device for device in mesh.devices.flat if device.process_index == jax.process_index()]
    kinds = set.intersection(*({memory.kind for memory in device.addressable_memories()} for device in local))
    return next((kind for kind in _HOST_KINDS if kind in kinds), None)


def record_copier(
    mesh: Mesh, sharding: Sharding | PyTree, memory: str
) -> Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]:
    """Returns `(state, grads) -> (state, grads)` as a record holds them.

    Called once the devices finished the record's step. Staged before that,
    behind the devices' last steps, the copy of a 49 MiB state took 10.6 ms
    against 4.1 ms on this CPU (the transfer of arrays not yet ready takes a
    slower path), while it saved a small state's record 0.1 ms.

    Args:
        mesh: the loop's devices.
        sharding: the state's sharding on them (the device copy's): one for
            every leaf, or a tree of them.
        memory: one of `RECORD_MEMORIES`. `"host"`: both as read-only numpy
            arrays in host memory (returns when they are there). `"device"`:
            the state copied on the devices (asynchronously), the gradients
            as they are (no update donates them).
    """
    if memory == DEVICE:
        copy_on_devices = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=sharding)
        return lambda state, grads: (copy_on_devices(state), grads)
    kind = host_memory_kind(mesh)
    plans: dict[tuple[Sharding, ...], tuple[list[bool], Callable[[list[jax.Array]], list[jax.Array]]]] = {}

    def plan(leaves: list[jax.Array], kind: str) -> tuple[list[bool], Callable[[list[jax.Array]], list[jax.Array]]]:
        """Which leaves move one replica, and the transfer of the sources to host memory (made once per layout)."""
        shardings = tuple([leaf.sharding for leaf in leaves])
        if shardings not in plans:
            one_replica = [len(s.device_set) > 1 and s.is_fully_replicated for s in shardings]
            sources = _sources(leaves, one_replica)
            out = [source.sharding.with_memory_kind(kind) for source in sources]
            if len({frozenset(source.sharding.device_set) for source in sources}) == 1:
                # One dispatch for every leaf: a fifth of the Python path of device_put's, leaf by leaf.
                transfer: Callable[[list[jax.Array]], list[jax.Array]]
                transfer = jax.jit(lambda arrays: arrays, out_shardings=out)
            else:  # a jit takes one device set
                transfer = functools.partial(jax.device_put, device=out)
            plans[shardings] = one_replica, transfer
        return plans[shardings]

    def to_host(state: PyTree, grads: PyTree) -> tuple[PyTree, PyTree]:
        leaves, treedef = jax.tree.flatten((state, grads))
        if kind is None:  # no host memory kind to stage in: a plain copy
            return jax.tree.unflatten(treedef, [_read_only(np.array(leaf)) for leaf in leaves])
        one_replica, transfer = plan(leaves, kind)
        staged = transfer(_sources(leaves, one_replica))  # every transfer starts before the first is waited for
        return jax.tree.unflatten(treedef, [_host_value(array) for array in staged])

    return to_host


def _sources(leaves: list[jax.Array], one_replica: list[bool]) -> list[jax.Array]:
    """What moves to host memory: a leaf, or one replica of a replicated leaf (this process's first)."""
    return [leaf.addressable_data(0) if one else leaf for leaf, one in zip(leaves, one_replica, strict=True)]


def _host_value(array: jax.Array) -> np.ndarray | jax.Array:
    """A numpy view of a host-memory array; a global array whose shards other processes hold stays one."""
    return np.asarray(array) if array.is_fully_addressable else array


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


class DeviceViews:
    """The loop's own device state behind its newest record's host copy, until the loop's next dispatch.

    A record carries `lookup` bound to its state (`Checkpoint.device_state`):
    an `EvalLoop` given that record (or a summary of it) evaluates the device
    arrays instead of putting the host copy's parameters on the devices
    again: no second copy of the parameters, no host-to-device transfer. The
    loop `clear`s its view before it dispatches (and donates).
    """

    def __init__(self) -> None:
        self._host: PyTree = None
        self._device: PyTree = None

    def publish(self, host: PyTree, device: PyTree) -> None:
        """Notes that `host` (a record's state) is a copy of `device` (the loop's state)."""
        self._host, self._device = host, device

    def clear(self) -> None:
        """Forgets the view: the loop is about to donate its state."""
        self._host = self._device = None

    def lookup(self, host: PyTree) -> PyTree | None:
        """The device state behind `host`, or `None` (another state, or the loop has dispatched since)."""
        return self._device if host is not None and host is self._host else None
