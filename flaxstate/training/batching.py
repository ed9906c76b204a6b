"""Batches: their accepted structure, their split across devices, their placement.

A batch is `(x, y)`, `((x, ...), (y, ...))` or `((x, ...), ())`: inputs go to
the model's `apply`, targets (with the model's outputs) to the loss. Each
process feeds its own per-host batch; it is split along its first axis across
the process's local devices and assembled into one global array.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "devices"
"""The name of the mesh axis that batches are split along and gradients averaged over."""

ACCEPTED_FORMS = "(x, y), ((x, ...), (y, ...)) or ((x, ...), ())"

Batch = tuple[tuple[Any, ...], tuple[Any, ...]]


_ARRAY_TYPES = (np.ndarray, jax.Array)


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _describe(value: Any) -> str:
    if _is_array(value):
        return f"array{list(value.shape)}"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(_describe(item) for item in value) + ")"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key!r}: {_describe(item)}" for key, item in value.items()) + "}"
    return type(value).__name__


def local_size(batch: Batch) -> int:
    """The examples in this process's part of a normalized batch: its first input's leading axis."""
    return int(np.shape(jax.tree.leaves(batch[0])[0])[0])


def normalize(batch: Any, task_name: str, whole: bool = False) -> Batch:
    """Returns a batch as `(inputs, targets)`, two tuples of arrays; `whole`: `((batch,), ())`, the batch one
    input as the data yields it (any tree of arrays: NNX's `loss_fn(model, batch)` takes it so).

    Raises:
        ValueError: the batch has none of the accepted forms (`whole`: holds no array, or a leaf that is none).
    """
    if whole:
        leaves = jax.tree.leaves(batch)
        if leaves and all(_is_array(leaf) for leaf in leaves) and all(np.ndim(leaf) >= 1 for leaf in leaves):
            return (batch,), ()
        raise ValueError(
            f"{task_name}.data yielded a batch of the wrong structure: {_describe(batch)}. A batch for "
            "loss_fn(model, batch) is any tree of arrays with a batch axis first (a dict {'image': x, 'label': y}, "
            "a tuple (x, y))."
        )
    if type(batch) is tuple and len(batch) == 2 and isinstance(batch[0], _ARRAY_TYPES):
        if isinstance(batch[1], _ARRAY_TYPES):
            return (batch[0],), (batch[1],)
    if isinstance(batch, tuple | list) and len(batch) == 2:
        parts = []
        for part in batch:
            if _is_array(part):
                parts.append((part,))
            elif isinstance(part, tuple | list) and all(_is_array(item) for item in part):
                parts.append(tuple(part))
            else:
                break
        else:
            if parts[0]:
                return parts[0], parts[1]
    raise ValueError(
        f"{task_name}.data yielded a batch of the wrong structure: {_describe(batch)}. "
        f"A batch is {ACCEPTED_FORMS}: inputs for apply, then targets for the loss."
    )


def global_spec(batch: Batch, batch_size: int) -> Any:
    """The abstract global batch of `batch_size` examples shaped as `batch` (a process's part), for XLA's FLOPs."""
    return jax.tree.map(
        lambda array: jax.ShapeDtypeStruct((batch_size, *np.shape(array)[1:]), np.asarray(array).dtype), batch
    )


def check_divisible(
    batch: Batch,
    n_devices: int,
    task_name: str,
    n_microbatches: int = 1,
    devices: str = "local devices",
    *,
    source: str | None = None,
    scope: str = "per-host",
) -> None:
    """Checks that every array's first axis splits evenly across the local devices, then into microbatches.

    Args:
        batch: a normalized batch.
        n_devices: how many parts this process's batch splits into.
        task_name: for the error.
        n_microbatches: M, how many microbatches each part splits into.
        devices: what the parts are, for the error (a sharded loop's:
            the parts of its batch axes that this process's devices hold).
        source: what yielded the batch, for the error (`"<task_name>.data
            yielded a batch"` by default; a plan's: its global batch).
        scope: which batch size the fix names (`"per-host"`, or a plan's `"global"`).

    Raises:
        ValueError: a size that does not divide by `n_devices`, naming both;
            a per-device size that does not divide by `n_microbatches`,
            naming the sizes and M.
    """
    source = f"{task_name}.data yielded a batch" if source is None else source
    for array in jax.tree.leaves(batch):
        if np.ndim(array) == 0 or array.shape[0] % n_devices:
            size = array.shape[0] if np.ndim(array) else "a scalar"
            raise ValueError(
                f"{source} of size {size}, which does not divide by the "
                f"{n_devices} {devices}; make the {scope} batch size a multiple of {n_devices}."
            )
        per_device = array.shape[0] // n_devices
        if per_device % n_microbatches:
            raise ValueError(
                f"{source} of size {array.shape[0]}: {per_device} examples a device "
                f"({n_devices} {devices}), which do not split into n_microbatches={n_microbatches} equal "
                f"microbatches; make the per-device batch size a multiple of {n_microbatches}."
            )


def mesh_of(devices: Sequence[jax.Device] | None) -> Mesh:
    """Returns the one-axis mesh of the given devices (all devices of all processes by default)."""
    return Mesh(np.asarray(list(devices) if devices is not None else jax.devices()), (AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    """Returns the sharding that holds one whole copy on every device of the mesh."""
    return NamedSharding(mesh, PartitionSpec())


def local_device_count(mesh: Mesh) -> int:
    """Returns how many of the mesh's devices this process feeds."""
    return sum(device.process_index == jax.process_index() for device in mesh.devices.flat)


def stack(batches: Sequence[Batch], first_step: int) -> Batch:
    """Stacks K batches along a new leading axis, for K steps in one dispatch.

    Raises:
        ValueError: the batches differ in shape (a ragged last batch), naming
            the steps and the shapes.
    """
    n_inputs, n_targets = len(batches[0][0]), len(batches[0][1])
    try:
        if any(len(inputs) != n_inputs or len(targets) != n_targets for inputs, targets in batches):
            raise ValueError("the batches differ in structure")
        # Spelled out, not a tree map: this runs once a dispatch, and a tree map over K batches costs more.
        # `np.array` of equal arrays stacks them as `np.stack` does (dtype and all), in C: 1.5 against 4.4 us
        # for ten 8 x 16 arrays (`np.stack` expands each in Python); unequal ones raise ValueError as it does.
        return (
            tuple([_stacked([batch[0][index] for batch in batches]) for index in range(n_inputs)]),
            tuple([_stacked([batch[1][index] for batch in batches]) for index in range(n_targets)]),
        )
    except ValueError:
        shapes = [[list(np.shape(array)) for array in jax.tree.leaves(batch)] for batch in batches]
        if all(shape == shapes[0] for shape in shapes):
            raise
        odd = next(index for index, shape in enumerate(shapes) if shape != shapes[0])
        raise ValueError(
            f"TrainTask.data yielded batches of different shapes for one dispatch of {len(batches)} steps "
            f"(steps {first_step}-{first_step + len(batches) - 1}): step {first_step} has {shapes[0]}, step "
            f"{first_step + odd} has {shapes[odd]}. n_steps_per_dispatch > 1 stacks equal batches: drop the "
            "ragged last batch (e.g. grain's batch(..., drop_remainder=True)), or use n_steps_per_dispatch=1."
        ) from None


def _stacked(parts: list[Any]) -> Any:
    """K arrays stacked along a new first axis (K trees of arrays, leaf by leaf: a whole batch's dict)."""
    if _is_array(parts[0]):
        return np.array(parts)
    structure: Any = jax.tree.structure(parts[0])
    if any(jax.tree.structure(part) != structure for part in parts):
        raise ValueError("the batches differ in structure")
    return jax.tree.map(lambda *leaves: np.array(leaves), *parts)


def to_devices(batch: Batch, mesh: Mesh, stacked: bool, sharding: NamedSharding | None = None) -> Batch:
    """Puts a per-host batch on the mesh, split along its batch axis (asynchronously).

    In one process the batch stays in host memory: the compiled step, which
    states its input shardings, splits and places it itself at dispatch, in
    JAX's C++ dispatch path. That measured faster on both a CPU and an H100
    than putting batches on the devices ahead of use with `jax.device_put`,
    whose Python path costs more per step than a small model's whole update
    (benchmarks/batch_placement.py, benchmarks/RESULTS.md). Several processes
    must build global arrays from their per-host parts, which is done here,
    ahead of use.

    Args:
        batch: this process's batch (numpy or jax arrays).
        mesh: the loop's mesh.
        stacked: whether the batch has a leading axis of steps.
        sharding: the global batch's sharding (a sharded loop's); by
            default split along the batch axis over every device of `mesh`.

    Returns:
        the batch as global arrays sharded along the batch axis, or as host
        arrays for the compiled step to place.
    """
    if jax.process_count() == 1:
        return batch
    sharding = sharding or NamedSharding(mesh, batch_spec(stacked))
    return jax.tree.map(lambda array: jax.make_array_from_process_local_data(sharding, np.asarray(array)), batch)


def batch_spec(stacked: bool) -> PartitionSpec:
    """Returns the partition spec of a batch inside the mapped step."""
    return PartitionSpec(None, AXIS) if stacked else PartitionSpec(AXIS)
