"""Shardings from logical axis names: a mesh, flax-style rules, and the checks made before anything compiles.

A model names the axes of its parameters (`nn.with_logical_partitioning`,
T5X's `param_with_axes`): `("embed", "mlp")`. Rules map those names to the
axes of a `jax.sharding.Mesh`, in flax's `logical_axis_rules` form:
`[("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "model")]`. The
mapping itself is flax's (`nn.logical_to_mesh_axes`: the first rule whose
mesh axes the array does not already use); this module adds what a user
needs to hear before a compile fails far from the cause: a rule naming a mesh
axis that does not exist, a logical axis that no rule names (replicated, with
one warning), and a dimension that its mesh axes do not divide, each naming
the leaf's path, the axis and the sizes.

The batch is sharded along its first dimension over the mesh axes of the
logical axis `batch` (`BATCH`). Each process feeds the part of the global
batch that its devices hold (`BatchLayout.process_part`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any, cast

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from flaxstate import tree_paths

PyTree = Any
AxisRules = Sequence[tuple[str, str | Sequence[str] | None]]
"""flax's logical axis rules: `(logical name, mesh axis or axes or None)` pairs, first match wins."""

BATCH = "batch"
"""The logical name of a batch's first dimension."""

_warned: set[tuple[str, ...]] = set()
"""The warnings said in this process (a registry: TrainLoop, EvalLoop and readers compute shardings of the same
state many times, and a user should hear of an unruled axis or a model without axes once)."""


CheckedRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]
"""Axis rules as `check_rules` returns them: pairs, each mesh axis a name, a tuple of names, or `None`."""


def check_rules(mesh: Mesh, rules: AxisRules) -> CheckedRules:
    """Returns the rules as tuples, checked against the mesh.

    Raises:
        ValueError: a rule is not a `(name, mesh axes)` pair, or names a mesh
            axis that the mesh does not have (naming both, and the mesh's axes).
    """
    checked = []
    for rule in rules:
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(
                f"axis_rules has {rule!r}; each rule is a (logical name, mesh axis) pair, e.g. ('embed', 'fsdp'), "
                "('batch', ('data', 'fsdp')) or ('kv', None)."
            )
        name, target = rule
        axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        unknown = [axis for axis in axes if axis not in mesh.axis_names]
        if unknown:
            raise ValueError(
                f"axis_rules maps the logical axis {name!r} to mesh axis {unknown[0]!r}, which the mesh does not "
                f"have: its axes are {tuple(mesh.axis_names)} (sizes {dict(mesh.shape)}). Name one of those, or "
                "add the axis to the mesh."
            )
        checked.append((name, target if target is None or isinstance(target, str) else tuple(target)))
    return tuple(checked)


def _warn_once(key: tuple[str, ...], message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def _mesh_axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _is_spec(value: Any) -> bool:
    return isinstance(value, PartitionSpec)


def logical_shardings(state: PyTree, mesh: Mesh, rules: AxisRules) -> PyTree:
    """Returns a `NamedSharding` per leaf of a state, from its logical axes through the rules.

    Optimizer-state leaves follow their parameter (`as_logical_axes`); leaves
    without names (a step count, a model that names no axes) are replicated.

    Args:
        state: a `FlaxOptimTrainState` or `InferenceState` (arrays or
            `jax.ShapeDtypeStruct` leaves).
        mesh: the devices, with named axes.
        rules: flax-style logical axis rules.

    Returns:
        the state's tree with a `NamedSharding` at every leaf.

    Raises:
        ValueError: a rule names a mesh axis that does not exist; a dimension
            is not divisible by the size of the mesh axes it is sharded over,
            naming the leaf's path, the logical and mesh axes and the sizes.

    Warns (once each): a logical axis that no rule names (that dimension is
    replicated); a model that names no axes at all (its state is replicated).
    """
    rules = check_rules(mesh, rules)
    if getattr(state, "params_axes", None) is None:
        _warn_once(
            ("no axes", str(jax.tree.structure(state.params))),  # once per model
            "the model names no logical axes (nn.with_logical_partitioning): its whole state is replicated on every "
            "device of the mesh, and only the batch is sharded.",
        )
        return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), state)
    axes = state.as_logical_axes()
    named = {name for name, _ in rules}
    flat_axes = tree_paths.flatten(axes, is_leaf=_is_spec)
    flat_state = tree_paths.flatten(state)
    shardings = {}
    for path, logical in flat_axes.items():
        leaf = flat_state[path]
        shape = tuple(np.shape(leaf))
        if len(logical) > len(shape):
            raise ValueError(
                f"{path} has shape {shape} but {len(logical)} logical axes {tuple(logical)}: name one axis (or "
                "None) per dimension."
            )
        logical = tuple(logical) + (None,) * (len(shape) - len(logical))
        for name in logical:
            if name is not None and name not in named:
                _warn_once(
                    ("no rule", name),
                    f"no axis rule names the logical axis {name!r} (first seen at {path}, shape {shape}): it is "
                    f"replicated on every device. Add a rule such as ({name!r}, None) to say so, or map it to a "
                    "mesh axis to shard it.",
                )
        spec = nn.logical_to_mesh_axes(logical, rules)
        assert spec is not None  # names were given  # noqa: S101
        for dimension, (name, entry) in enumerate(zip(logical, spec, strict=True)):
            mesh_axes = _mesh_axes(entry)
            size = math.prod(mesh.shape[axis] for axis in mesh_axes)
            if shape[dimension] % size:
                raise ValueError(
                    f"{path} has shape {shape}: its dimension {dimension} (logical axis {name!r}, size "
                    f"{shape[dimension]}) is sharded over mesh axes {mesh_axes} of {size} devices, which do not "
                    f"divide it. Make the dimension a multiple of {size}, or map {name!r} to fewer devices."
                )
        shardings[path] = NamedSharding(mesh, spec)
    leaves_with_path = jax.tree_util.tree_flatten_with_path(state)
    return jax.tree.unflatten(
        leaves_with_path[1], [shardings[tree_paths.path_name(key_path)] for key_path, _ in leaves_with_path[0]]
    )


def sharded_like(state: PyTree, shardings: PyTree) -> PyTree:
    """Returns a `jax.ShapeDtypeStruct` per leaf of a state, with the given shardings: a template to restore into.

    Example (a training checkpoint into a sharded `InferenceState`):
        state = jax.eval_shape(lambda: InferenceState.create(model.init(rng, x)))
        template = sharded_like(state, logical_shardings(state, mesh, rules))
        state = CheckpointFileReader(directory).restore(template)
    """
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), state, shardings
    )


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """How a batch lies on the mesh: its first dimension over the mesh axes of the logical axis `batch`.

    Attributes:
        mesh: the devices.
        axes: the mesh axes the batch is split over (`()`: every device
            holds the whole batch).
    """

    mesh: Mesh
    axes: tuple[str, ...]

    @classmethod
    def create(cls, mesh: Mesh, rules: AxisRules) -> BatchLayout:
        """The batch's layout under the rules (a missing `batch` rule: replicated, with one warning)."""
        return cls.of_checked(mesh, check_rules(mesh, rules))

    @classmethod
    def of_checked(cls, mesh: Mesh, rules: CheckedRules) -> BatchLayout:
        """`create` for rules that `check_rules` already checked against the mesh (a `Partitioning`'s)."""
        if BATCH not in {name for name, _ in rules}:
            _warn_once(
                ("no rule", BATCH),
                f"no axis rule names the logical axis {BATCH!r}: every device computes the whole batch. Add a rule "
                f"such as ({BATCH!r}, ('data', 'fsdp')) to split it.",
            )
        spec = nn.logical_to_mesh_axes((BATCH,), rules)
        assert spec is not None  # a name was given  # noqa: S101
        return cls(mesh, _mesh_axes(spec[0]))

    def spec(self, stacked: bool) -> PartitionSpec:
        """The partition spec of a batch (with a leading axis of steps when `stacked`)."""
        entry = self.axes if self.axes else None
        return PartitionSpec(None, entry) if stacked else PartitionSpec(entry)

    def sharding(self, stacked: bool) -> NamedSharding:
        """The sharding of a batch (with a leading axis of steps when `stacked`)."""
        return NamedSharding(self.mesh, self.spec(stacked))

    @property
    def n_parts(self) -> int:
        """How many parts the global batch is split into."""
        return math.prod(self.mesh.shape[axis] for axis in self.axes)

    def _part_of(self, device_index: tuple[int, ...]) -> int:
        names = list(self.mesh.axis_names)
        part = 0
        for axis in self.axes:
            part = part * self.mesh.shape[axis] + device_index[names.index(axis)]
        return part

    def local_parts(self) -> list[int]:
        """The batch parts that this process's devices hold, in order."""
        index = jax.process_index()
        parts = {
            self._part_of(position)
            for position, device in np.ndenumerate(self.mesh.devices)
            if device.process_index == index
        }
        return sorted(parts)

    def process_part(self) -> tuple[int, int]:
        """Which part of the global batch this process feeds: `(index, count)` of equal, contiguous parts.

        FSDP over 2 processes: `(process, 2)`, each feeds half; tensor-parallel
        over 2 processes (`data=1, model=2`): `(0, 1)`, each feeds the whole batch.
        """
        parts = self.local_parts()
        return parts[0] // len(parts), self.n_parts // len(parts)


def _check_arguments(owner: str, devices: Any, mesh: Mesh | None, axis_rules: AxisRules | None) -> None:
    """Refuses a mesh without rules (or rules without a mesh), and a mesh with devices, naming `owner`.

    Raises:
        ValueError: naming the owner and what to pass.
    """
    if (mesh is None) != (axis_rules is None):
        raise ValueError(
            f"{owner} shards the state when given both mesh= and axis_rules= (flax-style logical axis rules); "
            f"got only {'mesh' if mesh is not None else 'axis_rules'}. Pass both, or neither for data-parallel "
            "work."
        )
    if mesh is not None and devices is not None:
        raise ValueError(f"{owner} takes devices= or mesh=, not both: a sharded loop runs on the mesh's devices.")


@dataclasses.dataclass(frozen=True)
class Partitioning:
    """Where a run's work goes, stated once for `TrainLoop`, `EvalLoop` and `global_batches`.

    Data-parallel over `devices` (every device of every process by
    default), or sharded over `mesh` by flax-style `axis_rules`. The rules
    are checked against the mesh once, here; the three that take it use the
    same checked rules and the same batch layout.

    Example:
        >>> import jax
        >>> from jax.sharding import Mesh
        >>> mesh = Mesh(jax.devices()[:1], ("data",))
        >>> where = Partitioning(mesh=mesh, axis_rules=[("batch", "data")])
        >>> where.sharded, where.process_part()
        (True, (0, 1))

    Args:
        devices: the devices of data-parallel work (`None`: all of them).
        mesh: a `jax.sharding.Mesh` with named axes (with `axis_rules`).
        axis_rules: `(logical name, mesh axis or axes or None)` pairs, first
            match wins (with `mesh`).

    Raises:
        ValueError: only one of `mesh` and `axis_rules`, `mesh` with
            `devices`, or rules that are not pairs or name an axis the mesh
            does not have.
    """

    devices: Sequence[jax.Device] | None = None
    mesh: Mesh | None = None
    axis_rules: AxisRules | None = None

    def __post_init__(self) -> None:
        _check_arguments(type(self).__name__, self.devices, self.mesh, self.axis_rules)
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(self.devices))
        if self.mesh is not None and self.axis_rules is not None:
            object.__setattr__(self, "axis_rules", check_rules(self.mesh, self.axis_rules))

    @property
    def sharded(self) -> bool:
        """Whether the state is sharded over a mesh (else every device holds it whole)."""
        return self.mesh is not None

    @functools.cached_property
    def batch_layout(self) -> BatchLayout | None:
        """How a sharded run's batch lies on the mesh (`None`: data-parallel)."""
        if self.mesh is None or self.axis_rules is None:
            return None
        return BatchLayout.of_checked(self.mesh, cast(CheckedRules, self.axis_rules))  # checked when made

    def process_part(self) -> tuple[int, int]:
        """This process's part of a global batch, and how many parts there are (see `BatchLayout.process_part`)."""
        if self.batch_layout is None:
            return jax.process_index(), jax.process_count()
        return self.batch_layout.process_part()


def resolve(
    owner: str,
    partitioning: Partitioning | None,
    devices: Sequence[jax.Device] | None = None,
    mesh: Mesh | None = None,
    axis_rules: AxisRules | None = None,
) -> Partitioning:
    """`partitioning`, or one made from the keywords that came before it (`devices=`, `mesh=`, `axis_rules=`).

    Inside `jax.set_mesh(mesh)`, `mesh=` may be left out: the context's mesh
    is used (with `axis_rules=`).

    Raises:
        ValueError: `partitioning` with any of the keywords, keywords that
            `Partitioning` refuses, a mesh that differs from the `jax.set_mesh`
            one around the call, or that context without `axis_rules=`, naming
            `owner`.
    """
    context = context_mesh()
    if partitioning is not None:
        keywords = (("devices", devices), ("mesh", mesh), ("axis_rules", axis_rules))
        given = [name for name, value in keywords if value is not None]
        if given:
            raise ValueError(
                f"{owner} takes partitioning= or {'/'.join(f'{name}=' for name in given)}, not both: "
                "the partitioning already says where the work goes."
            )
        if not isinstance(partitioning, Partitioning):
            raise TypeError(f"{owner} partitioning= takes an fs.Partitioning, got {type(partitioning).__name__}.")
        _check_context(owner, "partitioning.mesh", partitioning.mesh, context)
        return partitioning
    if context is not None and devices is None:
        _check_context(owner, "mesh=", mesh, context)
        if axis_rules is None:
            raise ValueError(
                f"{owner} is inside jax.set_mesh({describe_mesh(context)}) but has no axis_rules=: give the rules "
                "that map the model's axis names and 'batch' to that mesh's axes (e.g. [('batch', "
                f"{context.axis_names[0]!r})]) to shard over it, or make it outside the mesh context (or with "
                "devices=) for data-parallel work."
            )
        mesh = context
    _check_arguments(owner, devices, mesh, axis_rules)
    return Partitioning(devices=devices, mesh=mesh, axis_rules=axis_rules)


def context_mesh() -> Mesh | None:
    """The mesh that `jax.set_mesh` set for the calling thread, or `None` outside any."""
    mesh = jax.sharding.get_mesh()
    return None if mesh.empty else mesh


def describe_mesh(mesh: Mesh) -> str:
    """A mesh's axes, sizes and axis types, as an error names it: `{'fsdp': 2} (Explicit)`."""
    return f"{dict(mesh.shape)} ({', '.join(sorted({kind.name for kind in mesh.axis_types}))})"


def uses_context(mesh: Mesh) -> bool:
    """Whether work on `mesh` is traced under `jax.set_mesh(mesh)`: an axis that is not Auto (JAX's sharding in
    types: `PartitionSpec`s and `out_sharding=` resolve against the mesh context), or the caller's own mesh
    context. An Auto mesh given without one is traced as before, without it."""
    return any(kind != AxisType.Auto for kind in mesh.axis_types) or context_mesh() == mesh


def _check_context(owner: str, what: str, mesh: Mesh | None, context: Mesh | None) -> None:
    """Refuses a mesh that differs from the caller's `jax.set_mesh` one, naming both."""
    if mesh is not None and context is not None and mesh != context:
        raise ValueError(
            f"{owner}'s {what} ({describe_mesh(mesh)}) is not the mesh of the jax.set_mesh around it "
            f"({describe_mesh(context)}): leave {what.rstrip('=')} out to use the context's mesh, or give the same "
            "mesh to both."
        )


def logical_axes_by_path(state: PyTree) -> dict[str, list[str | None]]:
    """Returns each named leaf's logical axes by its state-dict path ('target/Dense_0/kernel'), for a checkpoint.

    Leaves without names (and every leaf of a model that names none) are left out.
    """
    if getattr(state, "params_axes", None) is None:
        return {}
    flat = tree_paths.flatten(state.as_logical_axes().state_dict(), is_leaf=_is_spec)
    return {
        path: list(spec) for path, spec in flat.items() if _is_spec(spec) and any(name is not None for name in spec)
    }
