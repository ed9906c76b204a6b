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
view of that host buffer, which waits for the transfer. On a CPU, whose device
memory is host memory, numpy copies each leaf (`np.array`): a small MLP's
state in 45 us against 125 us through the compiled identity, while the devices
wait. A large leaf's copy is aligned as a CPU device's buffer is, so that a
record's fingerprint, taken when first read, reads it where it is
(`on_devices`) and not a second copy of the state. A numpy *view* of the
device buffer (`np.asarray` of the state itself) would be no copy on a CPU,
and the next dispatch could then not donate that buffer: XLA would silently
allocate the state anew. (Views with the next dispatch undonated were tried
in issue 100: that undonated update is one more program, whose compile fell
in a run's second record.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, Sharding
from jax.tree_util import PyTreeDef

PyTree = Any
Copier = Callable[[list[jax.Array], PyTreeDef, PyTree], tuple[PyTree, PyTree]]
"""`(state_leaves, treedef, grads) -> (state, grads)`: the copies that a record holds."""
HOST, DEVICE = "host", "device"
RECORD_MEMORIES = (HOST, DEVICE)
_HOST_KINDS = ("pinned_host", "unpinned_host")
"""Host memory kinds, preferred first: pinned memory is what a device copies to at full speed."""


def host_memory_kind(mesh: Mesh) -> str | None:
    """The host memory kind that every local device of `mesh` has, or `None` (a platform without one)."""
    local = [device for device in mesh.devices.flat if device.process_index == jax.process_index()]
    kinds = set.intersection(*({memory.kind for memory in device.addressable_memories()} for device in local))
    return next((kind for kind in _HOST_KINDS if kind in kinds), None)


def reads_later(mesh: Mesh, memory: str) -> bool:
    """Whether a record of a loop on `mesh` holds numpy copies of the whole state that a later read can
    fingerprint on the devices as the loop's own arrays (a CPU's, in this process, records in host memory):
    there the record's fingerprint is taken when it is first read (`flaxstate.training.recording`)."""
    devices = list(mesh.devices.flat)
    return memory == HOST and all(d.platform == "cpu" and d.process_index == jax.process_index() for d in devices)


def record_copier(mesh: Mesh, sharding: Sharding | PyTree, memory: str) -> Copier:
    """Returns `(state_leaves, treedef, grads) -> (state, grads)` as a record holds them.

    The state comes as the loop holds it, its leaves and its tree's
    structure: flattening a train state again cost a record 80 us here. Called
    once the devices finished the record's step. Staged before that,
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
        out = sharding if isinstance(sharding, Sharding) else jax.tree.leaves(sharding)
        copy_on_devices = jax.jit(lambda leaves: [jnp.copy(leaf) for leaf in leaves], out_shardings=out)
        return lambda leaves, treedef, grads: (jax.tree.unflatten(treedef, copy_on_devices(leaves)), grads)
    kind = host_memory_kind(mesh)
    on_cpu = all(device.platform == "cpu" for device in mesh.devices.flat)
    Transfer = Callable[[list[jax.Array]], list[jax.Array]] | None
    plans: dict[tuple[Sharding, ...], tuple[list[bool], Transfer]] = {}

    def plan(leaves: list[jax.Array]) -> tuple[list[bool], Transfer]:
        """Which leaves move one replica, and their transfer to host memory (None: numpy copies), once per layout."""
        shardings = tuple([leaf.sharding for leaf in leaves])
        if shardings not in plans:
            one_replica = [len(s.device_set) > 1 and s.is_fully_replicated for s in shardings]
            sources = _sources(leaves, one_replica)
            transfer: Transfer = None
            if kind is not None and not (on_cpu and all(source.is_fully_addressable for source in sources)):
                out = [source.sharding.with_memory_kind(kind) for source in sources]
                if len({frozenset(source.sharding.device_set) for source in sources}) == 1:
                    # One dispatch for every leaf: a fifth of the Python path of device_put's, leaf by leaf.
                    transfer = jax.jit(lambda arrays: arrays, out_shardings=out)
                else:  # a jit takes one device set
                    transfer = functools.partial(jax.device_put, device=out)
            plans[shardings] = one_replica, transfer
        return plans[shardings]

    def to_host(state_leaves: list[jax.Array], treedef: PyTreeDef, grads: PyTree) -> tuple[PyTree, PyTree]:
        grads_leaves, grads_def = jax.tree.flatten(grads)
        leaves = [*state_leaves, *grads_leaves]
        one_replica, transfer = plan(leaves)
        sources = _sources(leaves, one_replica)
        copied: list[np.ndarray | jax.Array]
        if transfer is None:  # host memory already (a CPU's), or no host memory kind to stage in: numpy copies
            copied = [_read_only(_aligned_copy(np.asarray(source))) for source in sources]
        else:
            staged = transfer(sources)  # every transfer starts before the first is waited for
            copied = [_host_value(array) for array in staged]
        n_state = len(state_leaves)
        return jax.tree.unflatten(treedef, copied[:n_state]), jax.tree.unflatten(grads_def, copied[n_state:])

    return to_host


def _sources(leaves: list[jax.Array], one_replica: list[bool]) -> list[jax.Array]:
    """What moves to host memory: a leaf, or one replica of a replicated leaf (this process's first)."""
    return [leaf.addressable_data(0) if one else leaf for leaf, one in zip(leaves, one_replica, strict=True)]


def _host_value(array: jax.Array) -> np.ndarray | jax.Array:
    """A numpy view of a host-memory array; a global array whose shards other processes hold stays one."""
    return np.asarray(array) if array.is_fully_addressable else array


_ALIGNMENT = 64
"""The bytes a CPU device's buffer is aligned to: a numpy array so aligned becomes a device array without a copy."""


_ALIGNED_FROM = 1 << 16
"""A leaf of fewer bytes is copied by `np.array` (1.5 against 4.9 us for 4 KiB): `on_devices` copies it again."""


def _aligned_copy(view: np.ndarray) -> np.ndarray:
    """A copy of `view` at an address of a multiple of `_ALIGNMENT` (numpy's own are of 16: `on_devices` copied
    the whole state to fingerprint it, 256 MiB beyond a save's budget in `test_host_memory_processes.py`)."""
    if view.nbytes < _ALIGNED_FROM:
        return np.array(view)
    raw = np.empty(view.nbytes + _ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % _ALIGNMENT
    copy = raw[start : start + view.nbytes].view(view.dtype).reshape(view.shape)
    np.copyto(copy, view)
    return copy


def on_devices(leaf: Any) -> Any:
    """A record's numpy copy (on a CPU) as a device array over the same bytes, not copied; any other leaf as is."""
    return jax.device_put(leaf, may_alias=True) if isinstance(leaf, np.ndarray) else leaf


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


class DeviceViews:
    """The loop's own device state behind its newest record's host copy, until the loop's next dispatch.

    A record carries `lookup` bound to its state (`Checkpoint.device_state`):
    an `EvalLoop` given that record (or a summary of it) evaluates the device
    arrays instead of putting the host copy's parameters on the devices
    again: no second copy of the parameters, no host-to-device transfer. The
    loop `clear`s its view before it dispatches (and donates). The view keeps
    the loop's flat leaves and builds the state from them at the first lookup
    (most records are never evaluated from the loop's arrays).
    """

    def __init__(self) -> None:
        self._host: PyTree = None
        self._device: PyTree = None
        self._leaves: list[jax.Array] = []
        self._treedef: PyTreeDef | None = None

    def publish(self, host: PyTree, leaves: list[jax.Array], treedef: PyTreeDef) -> None:
        """Notes that `host` (a record's state) is a copy of the loop's state, held as `leaves` of `treedef`."""
        self._host, self._device, self._leaves, self._treedef = host, None, leaves, treedef

    def clear(self) -> None:
        """Forgets the view: the loop is about to donate its state."""
        self._host, self._device, self._leaves, self._treedef = None, None, [], None

    def lookup(self, host: PyTree) -> PyTree | None:
        """The device state behind `host`, or `None` (another state, or the loop has dispatched since)."""
        if host is None or host is not self._host or self._treedef is None:
            return None
        if self._device is None:
            self._device = jax.tree.unflatten(self._treedef, self._leaves)
        return self._device
