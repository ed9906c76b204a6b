"""Where a loop runs: the one module that knows data-parallel from sharded.

`TrainLoop` and `EvalLoop` take the same `fs.Partitioning` (or the
`devices=` or `mesh=` with `axis_rules=` it is made from), and `create` turns
it into one of two strategies behind one interface (`Placement`):

- `DataParallel`: every device holds the whole state and computes on its part
  of the batch, split over the local devices; the step functions are per
  device, mapped with `jax.shard_map` under `jax.jit` (gradients, the loss
  and the mutable collections averaged with `pmean`).
- `Sharded`: each state leaf is sharded by its logical axes through the rules
  (optimizer state as its parameter; unnamed leaves, and axes that no rule
  names, replicated, the latter with a warning), and the batch over the mesh
  axes of the logical axis `batch`; the step functions are the global ones
  (the global batch's loss, gradients and batch statistics), compiled once
  with `jax.jit` and explicit shardings (GSPMD inserts the collectives), the
  state donated. Each process feeds the part of the global batch that its
  devices hold along the batch axes (`BatchLayout.process_part`): FSDP over
  two processes, half each; tensor-parallel (`data=1, model=2`), the whole
  batch each. Dropout rngs are drawn per step for the global batch, so the
  masks do not depend on the mesh. A mesh whose shardings are types (an
  Explicit axis, `jax.make_mesh`'s default) or that the caller set with
  `jax.set_mesh` is traced under `jax.set_mesh` (`Sharded.context`), on the
  caller's thread and on the compile threads alike.

The step functions themselves (`flaxstate.training.step`) carry no mode: a
placement hands them its `Across` (how devices are told apart and averaged)
and compiles what they return. A third placement (pipeline stages, hybrid
rules) is a third class here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flaxstate import sharding
from flaxstate.sharding import AxisRules, BatchLayout, Partitioning, logical_shardings
from flaxstate.training import batching

PyTree = Any


class Across(Protocol):
    """How a step function sees the devices it runs on: its index among them, and a mean over them."""

    def index(self) -> jax.Array | int:
        """This device's index (folded into its rngs)."""
        ...

    def mean(self, tree: PyTree) -> PyTree:
        """The mean over the devices: floating leaves averaged, others (counters) their maximum."""
        ...


@dataclasses.dataclass(frozen=True)
class _PerDevice:
    """A per-device function mapped over `n_devices` along `batching.AXIS`."""

    n_devices: int

    def index(self) -> jax.Array | int:
        return lax.axis_index(batching.AXIS) if self.n_devices > 1 else 0

    def mean(self, tree: PyTree) -> PyTree:
        if self.n_devices == 1:
            return tree
        return jax.tree.map(
            lambda x: (
                lax.pmean(x, batching.AXIS) if jnp.issubdtype(x.dtype, jnp.inexact) else lax.pmax(x, batching.AXIS)
            ),
            tree,
        )


class _Global:
    """A global function (GSPMD partitions it): one device's view, nothing to average."""

    def index(self) -> jax.Array | int:
        return 0

    def mean(self, tree: PyTree) -> PyTree:
        return tree


class Placement(Protocol):
    """What a loop asks of where it runs (see the module's docstring for the two there are)."""

    @property
    def mesh(self) -> Mesh: ...

    @property
    def across(self) -> Across: ...

    @property
    def n_local_devices(self) -> int: ...

    @property
    def n_local_parts(self) -> int: ...

    def check_batch(self, batch: batching.Batch, task_name: str, n_microbatches: int = 1) -> None: ...

    def global_batch_size(self, local_size: int) -> int: ...

    def process_part(self) -> tuple[int, int]: ...

    def state_shardings(self, state: PyTree) -> PyTree: ...

    def to_devices(self, batch: batching.Batch, stacked: bool) -> batching.Batch: ...

    def compile_update(
        self, program: Callable[..., Any], shardings: PyTree, stacked: bool, gradients: bool, fingerprinted: bool
    ) -> Callable[..., Any]: ...

    def compile_eval(self, program: Callable[..., Any], shardings: PyTree) -> Callable[..., Any]: ...

    def context(self) -> contextlib.AbstractContextManager[Any]: ...


def create(partitioning: Partitioning) -> DataParallel | Sharded:
    """The data-parallel or sharded placement of a partitioning (its rules were checked when it was made)."""
    if partitioning.mesh is None or partitioning.axis_rules is None or partitioning.batch_layout is None:
        return DataParallel(batching.mesh_of(partitioning.devices), sharding.context_mesh() is not None)
    mesh = partitioning.mesh
    return Sharded(mesh, tuple(partitioning.axis_rules), partitioning.batch_layout, sharding.uses_context(mesh))


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """Every device holds the whole state (replicated) and computes on its part of the batch.

    Attributes:
        mesh: the devices, on one axis (`batching.AXIS`).
        in_context: made inside the caller's `jax.set_mesh` (`devices=`
            given there): traced with that context cleared, on every thread.
    """

    mesh: Mesh
    in_context: bool = False

    @property
    def across(self) -> Across:
        return _PerDevice(self.mesh.size)

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """No mesh context: its programs name their shardings on its one Auto axis (a caller's is cleared)."""
        return jax.set_mesh(None) if self.in_context else contextlib.nullcontext()

    @property
    def n_local_devices(self) -> int:
        """How many of the mesh's devices this process holds."""
        return batching.local_device_count(self.mesh)

    @property
    def n_local_parts(self) -> int:
        """How many parts this process's batch splits into: its devices."""
        return self.n_local_devices

    def check_batch(self, batch: batching.Batch, task_name: str, n_microbatches: int = 1) -> None:
        """Checks that this process's batch splits over its devices, then into microbatches.

        Raises:
            ValueError: naming the sizes, the device count and M.
        """
        batching.check_divisible(batch, self.n_local_devices, task_name, n_microbatches, "local devices")

    def global_batch_size(self, local_size: int) -> int:
        """The global batch's size when this process feeds `local_size` examples."""
        return local_size * jax.process_count()

    def process_part(self) -> tuple[int, int]:
        """Which part of the global batch this process feeds: `(index, count)` of equal, contiguous parts."""
        return jax.process_index(), jax.process_count()

    def state_shardings(self, state: PyTree) -> NamedSharding:
        """Replicated: one sharding for every leaf."""
        return batching.replicated(self.mesh)

    def to_devices(self, batch: batching.Batch, stacked: bool) -> batching.Batch:
        """This process's batch as global arrays (several processes) or as it is (see `batching.to_devices`)."""
        return batching.to_devices(batch, self.mesh, stacked=stacked)

    def compile_update(
        self, program: Callable[..., Any], shardings: PyTree, stacked: bool, gradients: bool, fingerprinted: bool
    ) -> Callable[..., Any]:
        """Maps `program(state_leaves, batches, rng_data)` over the devices, the state donated (outputs replicated).

        Each device's fingerprint (`fingerprinted`) is of its whole replica: the same on every device.
        """
        return self._map(program, stacked, donate=(0,))

    def compile_eval(self, program: Callable[..., Any], shardings: PyTree) -> Callable[..., Any]:
        """Maps `program(state, batch, rng_data) -> metrics` over the devices (nothing donated)."""
        return self._map(program, False, donate=())

    def _map(self, per_device: Callable[..., Any], stacked: bool, donate: tuple[int, ...]) -> Callable[..., Any]:
        """Compiles `per_device(state, batch, rng_data)` over the mesh: the state and outputs replicated.

        The compiled call states where its inputs live, so it takes host arrays
        (placed by the call itself, the fastest path on a CPU) as well as arrays
        already on the devices. On a single device the function is compiled as
        it is: no collective is needed, and the update is the XLA program a
        hand-written jit loop runs.
        """
        replicated = PartitionSpec()
        in_specs = (replicated, batching.batch_spec(stacked), replicated)
        in_shardings = tuple(NamedSharding(self.mesh, spec) for spec in in_specs)
        if self.mesh.size == 1:
            return jax.jit(per_device, in_shardings=in_shardings, donate_argnums=donate)
        mapped = jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=in_specs,
            out_specs=replicated,
            # Per-device gradients as under pmap: with check_vma, the gradient of a replicated
            # parameter would already be summed over devices before our explicit pmean.
            check_vma=False,
        )
        return jax.jit(mapped, in_shardings=in_shardings, donate_argnums=donate)


@dataclasses.dataclass(frozen=True)
class Sharded:
    """Each state leaf sharded by its logical axes through the rules; the batch over the batch axes.

    Attributes:
        mesh: the devices, with named axes.
        axis_rules: flax-style logical axis rules, checked against the mesh.
        batch_layout: how a batch lies on the mesh.
        in_context: traced under `jax.set_mesh(mesh)` (see `context`).
    """

    mesh: Mesh
    axis_rules: AxisRules
    batch_layout: BatchLayout
    in_context: bool = False

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """`jax.set_mesh(mesh)` where the run is traced under it (`in_context`: an Explicit axis, or the caller's
        own `jax.set_mesh`), on whichever thread traces; else nothing, so an Auto mesh's programs stay as they
        were."""
        return jax.set_mesh(self.mesh) if self.in_context else contextlib.nullcontext()

    @property
    def across(self) -> Across:
        return _Global()

    @property
    def n_local_devices(self) -> int:
        """How many of the mesh's devices this process holds."""
        return batching.local_device_count(self.mesh)

    def check_batch(self, batch: batching.Batch, task_name: str, n_microbatches: int = 1) -> None:
        """Checks that this process's batch splits into the batch parts its devices hold, then into microbatches.

        Raises:
            ValueError: naming the sizes, the parts and M.
        """
        parts = f"parts of the batch axes {self.batch_layout.axes} that this process's devices hold"
        batching.check_divisible(batch, self.n_local_parts, task_name, n_microbatches, parts)

    @property
    def n_local_parts(self) -> int:
        """How many parts this process's batch splits into: the batch parts its devices hold."""
        return len(self.batch_layout.local_parts())

    def global_batch_size(self, local_size: int) -> int:
        """The global batch's size when this process feeds `local_size` examples."""
        return local_size * self.batch_layout.n_parts // self.n_local_parts

    def process_part(self) -> tuple[int, int]:
        """Which part of the global batch this process feeds (`BatchLayout.process_part`)."""
        return self.batch_layout.process_part()

    def state_shardings(self, state: PyTree) -> PyTree:
        """One sharding per leaf, from its logical axes through the rules."""
        return logical_shardings(state, self.mesh, self.axis_rules)

    def to_devices(self, batch: batching.Batch, stacked: bool) -> batching.Batch:
        """This process's part of the global batch as global arrays (several processes) or as it is."""
        return batching.to_devices(batch, self.mesh, stacked=stacked, sharding=self.batch_layout.sharding(stacked))

    def compile_update(
        self, program: Callable[..., Any], shardings: PyTree, stacked: bool, gradients: bool, fingerprinted: bool
    ) -> Callable[..., Any]:
        """Compiles `program(state_leaves, batches, rng_data) -> (state_leaves, losses[, grads[, fingerprint]])`,
        the state donated.

        The gradients (`gradients`: a record's last step's) lie as their parameters; the state's
        fingerprint (`fingerprinted`: the global state's) is replicated.
        """
        leaves = jax.tree.leaves(shardings)
        out: tuple[Any, ...] = (leaves, self._replicated, shardings.params) if gradients else (leaves, self._replicated)
        out += (self._replicated,) if fingerprinted else ()
        return self._jit(program, leaves, stacked, out, donate=(0,))

    def compile_eval(self, program: Callable[..., Any], shardings: PyTree) -> Callable[..., Any]:
        """Compiles `program(state, batch, rng_data) -> metrics`: the global batch's, replicated."""
        return self._jit(program, shardings, False, self._replicated, donate=())

    @property
    def _replicated(self) -> NamedSharding:
        return batching.replicated(self.mesh)

    def _jit(
        self, function: Callable[..., Any], state: PyTree, stacked: bool, out: Any, donate: tuple[int, ...]
    ) -> Callable[..., Any]:
        in_shardings = (state, self.batch_layout.sharding(stacked), self._replicated)
        return jax.jit(function, in_shardings=in_shardings, out_shardings=out, donate_argnums=donate)
