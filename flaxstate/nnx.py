"""Flax NNX modules in the loop as Flax teaches them: the `nnx.Module` itself is the model.

`TrainLoop(init=model)`, `TrainTask(apply=model)`, `EvalTask(apply=model)`,
`CheckpointFileReader(dir, target=model)` and `fs.plan(model, ...)` take the
module. Its graph is split once, when the task is made (`NNXModel`): the
task keeps the graph and the Variables' shapes, never the module's arrays,
so the loop's state is the one copy of the parameters once the user lets the
module go. Inside each compiled step the module is merged from the state the
loop carries, called as the user configured it, and split again: nothing is
split or merged on the host between dispatches.

The state is a `FlaxOptimTrainState`, as for linen:

- `params`: the Variables that `wrt` selects (`nnx.Param` by default; any
  nnx filter, as `nnx.Optimizer(..., wrt=...)`: `nnx.LoRAParam` trains the
  adapters alone), trained by the optimizer. Their sharding metadata
  (`nnx.with_partitioning(init, ("embed", "mlp"))`) are their logical axes,
  which `mesh` + `axis_rules` shard.
- `flax_mutables`: every other Variable but the ephemeral `nnx.Cache` and
  `nnx.Intermediate`, one collection a Variable type (`batch_stats` for
  `nnx.BatchStat`, `rng_count` and `rng_key` for a module's own rng streams,
  `frozen_params` for Params that `wrt` leaves out, the user's own
  `nnx.Variable` subclasses by their name in snake_case), carried from step
  to step, floats averaged across the devices as batch statistics are
  (frozen Params, which a step does not change, are not), saved and
  restored.

A module whose `__call__` takes `rngs` gets an `nnx.Rngs` at each call: a
stream for each of the loop's rng collections (`TrainLoop(collections=
{"apply": [...]})`, `("dropout",)` by default) and a `default` one, each its
own key a step and a device from the loop's `rng`. A module that holds its
own streams (`nnx.Dropout(..., rngs=rngs)`) draws from them, and the loop
carries their counts: never the same mask twice, the same draws on resume.

The loss is linen's `loss(*outputs, *targets)` or NNX's `loss_fn(model,
batch)` / `loss_fn(model, batch, rngs)` (a scalar, or `(scalar, aux)` as
`nnx.value_and_grad(..., has_aux=True)` takes it): NNX's form where the
loss's first parameter is named `model` or `module`, or is annotated with an
`nnx.Module` class (`NNX_LOSS_NAMES`). It gets the batch as the data yields
it (a dict such as `{"image": x, "label": y}` included).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import variablelib

from flaxstate.train_state import StateMismatchError

PARAMS = "params"
"""The collection of the Variables the optimizer trains (linen's name)."""
FROZEN_PARAMS = "frozen_params"
"""The collection of the `nnx.Param`s that `wrt` leaves out (LoRA's base kernels)."""
EPHEMERAL = (nnx.Cache, nnx.Intermediate)
"""Variable types the loop does not keep: a decoding cache and sown intermediates, made again at each call."""
NNX_LOSS_NAMES = ("model", "module")
"""A loss whose first parameter has one of these names is NNX's `loss_fn(model, batch)`."""

Path = tuple[Any, ...]


def is_module(value: Any) -> bool:
    """Whether `value` is an `nnx.Module` (the module itself, which the loop's doors take)."""
    return isinstance(value, nnx.Module)


def refuse_nnx_object(value: Any, where: str) -> None:
    """Refuses an NNX object that is not a module where a module may go (an `nnx.Optimizer`, an `nnx.Rngs`, a
    `State`), naming the call and the class, never printing the object.

    Raises:
        TypeError: naming `where`, the class and what goes there.
    """
    if isinstance(value, nnx.Optimizer):
        raise TypeError(
            f"{where} got an nnx.Optimizer ({type(value).__name__}): give the module it optimizes "
            "(TrainLoop(init=model), TrainTask(apply=model, optimizer=optax.adamw(...), wrt=nnx.Param)); the loop "
            "makes and carries the optimizer's state itself."
        )
    if isinstance(value, nnx.Rngs | nnx.State | nnx.GraphDef) or (
        isinstance(value, nnx.Pytree) and not isinstance(value, nnx.Module)
    ):
        raise TypeError(
            f"{where} got an NNX {type(value).__name__}, not an nnx.Module: give the module itself (its Variables "
            "are read and written in place)."
        )


def takes_module(function: Callable[..., Any]) -> bool:
    """Whether a loss (or a metric) is NNX's form, `function(model, batch[, rngs])`: its first parameter is named
    `model` or `module`, or is annotated with an `nnx.Module` class."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    if not parameters or parameters[0].kind not in (parameters[0].POSITIONAL_ONLY, parameters[0].POSITIONAL_OR_KEYWORD):
        return False
    first = parameters[0]
    if first.name in NNX_LOSS_NAMES:
        return True
    try:
        annotation = typing.get_type_hints(function).get(first.name, first.annotation)
    except Exception:  # an annotation that does not resolve (a name defined later): its text
        annotation = first.annotation
    return isinstance(annotation, type) and issubclass(annotation, nnx.Module)


def _takes(function: Callable[..., Any], name: str, position: int | None = None) -> bool:
    """Whether `function` takes a parameter `name` (or any keyword), or with `position` a positional one there
    (counted from 0)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.name == name for p in parameters) or any(p.kind == p.VAR_KEYWORD for p in parameters):
        return True
    if position is None:
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) > position or any(p.kind == p.VAR_POSITIONAL for p in parameters)


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def collection_of(kind: type, trained: bool) -> str:
    """The state's collection of a Variable type: `params` where `wrt` trains it; else flax's registered name
    (`batch_stats`), `frozen_params` for a Param left out, or the type's name in snake_case."""
    if trained:
        return PARAMS
    try:
        name = variablelib.variable_name_from_type(kind)
    except (ValueError, KeyError):
        name = _snake(kind.__name__)
    return FROZEN_PARAMS if name == PARAMS else name


def _key(part: Any) -> str:
    return str(part)


def _nest(items: Iterable[tuple[Path, Any]]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for path, value in items:
        node = nested
        for part in path[:-1]:
            node = node.setdefault(_key(part), {})
        node[_key(path[-1])] = value
    return nested


def _lookup(nested: Mapping[str, Any], path: Path) -> Any:
    node: Any = nested
    for part in path:
        node = node[_key(part)]
    return node


def _value(variable: Any) -> Any:
    return variable.get_raw_value() if hasattr(variable, "get_raw_value") else variable.value


def _logical(variable: Any) -> tuple[str | None, ...] | None:
    """A Variable's logical axis names, from its sharding metadata (`nnx.with_partitioning`'s `out_sharding`,
    `sharding_names` or `sharding` in earlier flax), or `None` where it has none."""
    metadata = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
    for name in ("out_sharding", "sharding_names", "sharding"):
        names = metadata.get(name)
        if names:
            return tuple(getattr(names, "spec", names))
    return None


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one Variable of the module lives in the loop's state."""

    collection: str
    kind: type
    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...] | None
    averaged: bool
    """Whether the step returns it changed (and so averages it across the devices where it is a float)."""
    stored_shape: tuple[int, ...] = ()
    """Its shape in the state (a random key's raw data has one more axis than the key)."""
    key_impl: Any = None
    """A random key's implementation: the state holds its raw data (`jax.random.key_data`), which checkpoints,
    records and collectives take as any integer array."""

    def stored(self, value: Any) -> Any:
        """A Variable's value as the state holds it."""
        return value if self.key_impl is None else jax.random.key_data(value)

    def live(self, value: Any) -> Any:
        """A value of the state as the Variable holds it."""
        return value if self.key_impl is None else jax.random.wrap_key_data(value, impl=self.key_impl)


def _device_index() -> jax.Array | None:
    """The device's index in a per-device step of several devices (`training.placement`'s map), else `None`."""
    from flaxstate.training import batching  # the training wing imports this module

    try:
        n_devices = jax.lax.axis_size(batching.AXIS)
    except NameError:  # not inside the per-device map: a global (sharded) step draws over the global batch
        return None
    return jax.lax.axis_index(batching.AXIS) if n_devices > 1 else None


def _folded(key: jax.Array, index: jax.Array) -> jax.Array:
    """`key` (a random key, or an array of them) with `index` folded into each."""
    if not jnp.shape(key):
        return jax.random.fold_in(key, index)
    return jax.vmap(lambda each: jax.random.fold_in(each, index))(key.reshape(-1)).reshape(jnp.shape(key))


class NNXModel:
    """An `nnx.Module` as the loop runs it: its graph (split once), the Variables `wrt` trains and those it carries.

    It holds the graph and each Variable's place, type, shape and logical
    axes, not the module's arrays. `variables_of(module)` reads a module's
    values in the state's layout (linen's `{"params": ..., "batch_stats":
    ...}`); `apply`, `loss_apply` and `eval_apply` are what the compiled
    step calls; `update(module, variables)` writes values back.

    Args:
        module: the module (as the user configured it: its modes stay).
        wrt: the Variables the optimizer trains, an nnx filter.
        owner: the call that got the module, for errors.
        trains: whether `wrt` must select a Variable (a layout to write into a module need not).

    Raises:
        TypeError: not an `nnx.Module` (an `nnx.Optimizer`, say), naming the class.
        ValueError: `wrt` selects no Variable, or two Variable types share a collection's name.
    """

    def __init__(
        self, module: Any, wrt: Any = nnx.Param, owner: str = "TrainTask(apply=...)", trains: bool = True
    ) -> None:
        refuse_nnx_object(module, owner)
        if not is_module(module):
            raise TypeError(f"{owner} takes an nnx.Module, got {type(module).__name__}.")
        self.wrt = wrt
        self.module_type = type(module)
        self.graphdef, state = nnx.split(module)
        self.takes_rngs = _takes(type(module).__call__, "rngs")
        """Whether the module's `__call__` takes `rngs` (by name: the loop passes it so, after the inputs)."""
        trained = nnx.filterlib.to_predicate(wrt)
        ephemeral = nnx.filterlib.to_predicate(nnx.Any(*EPHEMERAL))
        self._slots: dict[Path, _Slot] = {}
        self._ephemeral: list[tuple[Path, type, jax.ShapeDtypeStruct]] = []
        kinds: dict[str, type] = {}
        for path, variable in nnx.to_flat_state(state):
            if ephemeral(path, variable):
                shape = jax.ShapeDtypeStruct(np.shape(_value(variable)), _dtype(variable))
                self._ephemeral.append((path, type(variable), shape))
                continue
            is_trained = bool(trained(path, variable))
            kind = type(variable)
            name = collection_of(kind, is_trained)
            if not is_trained and kinds.setdefault(name, kind) is not kind:
                raise ValueError(
                    f"{owner}: the Variable types {kinds[name].__module__}.{kinds[name].__qualname__} and "
                    f"{kind.__module__}.{kind.__qualname__} would share the state's collection {name!r}; rename "
                    "one (or register a name with flax.nnx.register_variable_name)."
                )
            value = _value(variable)
            is_key = jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key)
            self._slots[path] = _Slot(
                name,
                kind,
                tuple(np.shape(value)),
                jax.random.key_data(value).dtype if is_key else _dtype(variable),
                _logical(variable),
                averaged=not is_trained and not issubclass(kind, nnx.Param),
                stored_shape=tuple(np.shape(jax.random.key_data(value) if is_key else value)),
                key_impl=jax.random.key_impl(value) if is_key else None,
            )
        self._annotated = any(slot.axes for slot in self._slots.values())
        """Whether any Variable names logical axes: then every one does (unannotated ones replicated, `None` each)."""
        if trains and not any(slot.collection == PARAMS for slot in self._slots.values()):
            raise ValueError(
                f"{owner}: wrt={wrt!r} selects none of the module's Variables, so nothing would train; "
                f"it holds {sorted({slot.kind.__name__ for slot in self._slots.values()})}."
            )

    def __repr__(self) -> str:
        return f"NNXModel({self.module_type.__name__}, wrt={self.wrt!r})"

    @property
    def collections(self) -> tuple[str, ...]:
        """The state's collections: `params`, then the carried ones in the order the module holds them."""
        return tuple(dict.fromkeys(slot.collection for slot in self._slots.values()))

    def variables_of(self, module: Any, owner: str = "TrainLoop(init=...)") -> dict[str, Any]:
        """A module's values in the state's layout, the parameters boxed with their logical axes.

        Raises:
            StateMismatchError: the module's Variables differ from this model's (paths, types, shapes), naming them.
            TypeError: not a module.
        """
        refuse_nnx_object(module, owner)
        if not is_module(module):
            raise TypeError(f"{owner} takes the task's nnx.Module, got {type(module).__name__}.")
        found = {path: variable for path, variable in nnx.to_flat_state(nnx.state(module))}
        self._check(found, f"{owner}'s {type(module).__name__}")
        items = []
        for path, slot in self._slots.items():
            value = slot.stored(_value(found[path]))
            axes = slot.axes or ((None,) * len(slot.stored_shape) if self._annotated else None)
            items.append(((slot.collection, *path), value if axes is None else nn.LogicallyPartitioned(value, axes)))
        return _nest(items)

    def _check(self, found: Mapping[Path, Any], what: str) -> None:
        expected = {path: (slot.kind, slot.shape) for path, slot in self._slots.items()}
        given = {
            path: (type(variable), tuple(np.shape(_value(variable))))
            for path, variable in found.items()
            if not isinstance(variable, EPHEMERAL)
        }
        if expected == given:
            return
        show = "/".join
        missing = [show(map(str, path)) for path in expected if path not in given]
        unexpected = [show(map(str, path)) for path in given if path not in expected]
        differ = [
            f"{show(map(str, path))} (expected {expected[path][0].__name__}{list(expected[path][1])}, found "
            f"{given[path][0].__name__}{list(given[path][1])})"
            for path in expected
            if path in given and given[path] != expected[path]
        ]
        raise StateMismatchError(
            f"{what} does not match the task's module {self.module_type.__name__}: "
            + "; ".join(
                part
                for part in (
                    f"missing (expected, not found): {', '.join(missing)}" if missing else "",
                    f"unexpected (found, not expected): {', '.join(unexpected)}" if unexpected else "",
                    f"differ: {', '.join(differ)}" if differ else "",
                )
                if part
            )
        )

    def merge(self, variables: Mapping[str, Any]) -> Any:
        """The module, from values in the state's layout (inside a compiled step: traced arrays).

        In a per-device step of several devices, the module's own rng streams draw with the device's index folded
        into their keys: each device its own dropout mask, as the loop's streams (`training.step.device_rngs`); the
        state keeps the one key (`carried` returns it as it came), so a resume draws the same.
        """
        index = _device_index()
        items = []
        for path, slot in self._slots.items():
            value = slot.live(_lookup(variables[slot.collection], path))
            if index is not None and slot.key_impl is not None:
                value = _folded(value, index)
            items.append((path, slot.kind(value)))
        for path, kind, shape in self._ephemeral:  # a cache or sown values, made anew
            items.append((path, kind(jnp.zeros(shape.shape, shape.dtype))))
        return nnx.merge(self.graphdef, nnx.from_flat_state(items))

    def carried(self, module: Any, variables: Mapping[str, Any]) -> dict[str, Any]:
        """The values a call changed, in the state's layout: every carried Variable but the frozen Params (a random
        key as `variables` held it: a call draws from it, never replaces it, and `merge` may have folded it)."""
        found = dict(nnx.to_flat_state(nnx.state(module)))
        return _nest(
            (
                (slot.collection, *path),
                _lookup(variables[slot.collection], path)
                if slot.key_impl is not None
                else slot.stored(_value(found[path])),
            )
            for path, slot in self._slots.items()
            if slot.averaged and path in found
        )

    def rngs(self, keys: Mapping[str, jax.Array] | None) -> Any:
        """An `nnx.Rngs` of the loop's keys for one call (a `default` stream beside them), or `None` for none."""
        if not keys:
            return None
        first = next(iter(keys.values()))
        return nnx.Rngs(default=jax.random.fold_in(first, 0x6E6E78), **dict(keys))

    def call(self, module: Any, inputs: tuple[Any, ...], keys: Mapping[str, jax.Array] | None) -> Any:
        if self.takes_rngs:
            return module(*inputs, rngs=self.rngs(keys))
        return module(*inputs)

    def apply(
        self,
        variables: Mapping[str, Any],
        *inputs: Any,
        rngs: Mapping[str, jax.Array] | None = None,
        mutable: Any = False,
    ) -> Any:
        """linen's `apply`, as the step calls it: the module as configured, its changed Variables with `mutable`."""
        module = self.merge(variables)
        outputs = self.call(module, inputs, rngs)
        return (outputs, self.carried(module, variables)) if mutable else outputs

    def loss_apply(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """An `apply` whose output is NNX's `loss_fn(model, batch[, rngs])` (its first value where it returns
        `(loss, aux)`), the batch being the one input the step gives."""
        by_name = _takes(loss_fn, "rngs")  # loss_fn(model, batch, rngs=...) or (model, batch, **options)
        by_place = not by_name and _takes(loss_fn, "rngs", 2)  # loss_fn(model, batch, keys)

        def apply(
            variables: Mapping[str, Any], batch: Any, rngs: Mapping[str, jax.Array] | None = None, mutable: Any = False
        ) -> Any:
            module = self.merge(variables)
            if by_name:
                value = loss_fn(module, batch, rngs=self.rngs(rngs))
            else:
                value = loss_fn(module, batch, self.rngs(rngs)) if by_place else loss_fn(module, batch)
            value = value[0] if isinstance(value, tuple | list) else value
            return (value, self.carried(module, variables)) if mutable else value

        return apply

    def eval_apply(self, metric_fn: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """An `apply` that calls an evaluation view of the module (dropout off, running statistics: a view made
        inside the step, the user's module unchanged), or a metric's `metric_fn(model, batch)` on that view."""

        def apply(variables: Mapping[str, Any], *inputs: Any, rngs: Mapping[str, jax.Array] | None = None) -> Any:
            module = nnx.view(
                self.merge(variables), deterministic=True, use_running_average=True, raise_if_not_found=False
            )
            if metric_fn is not None:
                value = metric_fn(module, *inputs)
                return value[0] if isinstance(value, tuple | list) else value
            return self.call(module, inputs, rngs)

        return apply

    def update(self, module: Any, variables: Mapping[str, Any], owner: str = "nnx_update") -> Any:
        """Writes values in the state's layout into `module`'s Variables in place (as jax arrays: writable with
        `variable[...] = ...` and `+=`), and returns the module; nothing is written where anything differs.

        Raises:
            StateMismatchError: the module's Variables differ from this model's, or the values given from the
                module's (a path missing, one the module lacks, another shape), naming the paths and shapes.
        """
        found = dict(nnx.to_flat_state(nnx.state(module)))
        self._check(found, f"{owner}'s {type(module).__name__}")
        show = "/".join
        missing, differ, values = [], [], {}
        for path, slot in self._slots.items():  # looked up as `merge` does: a Variable may hold a dict of arrays
            key = (slot.collection, *map(_key, path))
            try:
                value = jax.tree.map(_unboxed, _lookup(variables[slot.collection], path), is_leaf=_is_boxed)
            except (KeyError, TypeError, IndexError):
                missing.append(f"{show(key)} ({list(slot.stored_shape)})")
                continue
            reference = slot.stored(_value(found[path]))
            if _shapes(value, reference) != _shapes(reference, reference):
                differ.append(
                    f"{show(key)} (expected {_shapes(reference, reference)}, found {_shapes(value, reference)})"
                )
                continue
            values[path] = (value, reference)
        covered = {(slot.collection, *map(_key, path)) for path, slot in self._slots.items()}
        given = {(name, *path): leaf for name, tree in variables.items() for path, leaf in _flatten(tree)}
        unexpected = [
            f"{show(key)} ({list(np.shape(_unboxed(leaf)))})"
            for key, leaf in given.items()
            if not any(key[:length] in covered for length in range(1, len(key) + 1))
        ]
        if missing or unexpected or differ:
            parts = (
                f"missing (the module's, not in the state): {', '.join(missing)}" if missing else "",
                f"unexpected (in the state, not the module's): {', '.join(unexpected)}" if unexpected else "",
                f"differ: {', '.join(differ)}" if differ else "",
            )
            raise StateMismatchError(
                f"{owner}: the state does not fit {type(module).__name__}: " + "; ".join(part for part in parts if part)
            )
        for path, (value, reference) in values.items():
            slot = self._slots[path]
            found[path].set_raw_value(slot.live(_placed(value, reference)))
        return module


def _is_boxed(value: Any) -> bool:
    return isinstance(value, nn.LogicallyPartitioned)


def _placed(value: Any, like: Any) -> Any:
    """A value given for a Variable as a jax array of the module's dtype (a dict's, array by array)."""
    if isinstance(like, Mapping):
        return {key: _placed(value[key], like[key]) for key in like}
    return jnp.array(value, dtype=np.asarray(like).dtype)


def _shapes(tree: Any, like: Any) -> Any:
    """A value's shape (a list), or where the Variable holds a dict (`like`), the shapes of its arrays by key: what
    must match, and what an error shows."""
    if isinstance(like, Mapping):
        if not isinstance(tree, Mapping):
            return f"a {type(tree).__name__}"
        return {str(key): _shapes(value, like.get(key)) for key, value in tree.items()}
    return list(np.shape(tree))


def _unboxed(value: Any) -> Any:
    return value.value if isinstance(value, nn.LogicallyPartitioned) else value


def nnx_update(model: Any, source: Any, *, use_ema: bool = False, wrt: Any = None) -> Any:
    """Puts a record's, a train state's or a checkpoint reader's newest state into an NNX module, in place.

    Every Variable the loop carries is written (parameters, batch
    statistics, the module's rng counts, the user's own Variables), as jax
    arrays the module owns (`module.layer.kernel[...] += 1.0` works; a
    record's host copies are read-only numpy arrays).

    Args:
        model: the `nnx.Module` (the one trained, or one built alike).
        source: a `Checkpoint` record, a `TrainState` (`loop.state`), or a
            reader (`CheckpointFileReader`): its newest checkpoint is read
            into the module's shapes, without the optimizer's state; or a
            `SafetensorsReader`: the params from its files (its `rename`
            and `transpose` applied), the module's other Variables kept.
        use_ema: the EMA of the parameters (`TrainTask(ema_decay=...)`)
            instead of the parameters.
        wrt: the Variables that were trained, as given to `TrainTask(wrt=)`
            (for a reader only: a record or a state says it; `None`:
            `nnx.Param`).

    Returns:
        the module.

    Raises:
        StateMismatchError: the module's Variables differ from the state's
            (missing, unexpected, or of another shape), naming the paths.
        ValueError: `use_ema` for a state without an EMA, or with a `SafetensorsReader`.
        TypeError: a source of another kind, or a model that is not a module.

    Example:
        >>> from flax import nnx
        >>> from flaxstate.train_state import InferenceState
        >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> state = InferenceState.create({"params": {"bias": [5.0], "kernel": [[1.0], [2.0]]}})
        >>> float(nnx_update(model, state).bias[0])
        5.0
    """
    refuse_nnx_object(model, "nnx_update")
    if not is_module(model):
        raise TypeError(f"nnx_update takes an nnx.Module, got {type(model).__name__}.")
    if callable(getattr(source, "params", None)):  # a SafetensorsReader: the params from its files, the rest kept
        if use_ema:
            raise ValueError("nnx_update(use_ema=True) takes a state or a run's reader; safetensors hold no EMA.")
        from flaxstate.train_state import InferenceState

        variables = NNXModel(model, nnx.Param if wrt is None else wrt, "nnx_update").variables_of(model, "nnx_update")
        params = source.params(nn.meta.unbox(variables[PARAMS]))
        return nnx_update(model, InferenceState.create({**variables, PARAMS: params}))
    state = getattr(source, "state", None) if not hasattr(source, "params") else source
    if state is None and callable(getattr(source, "restore", None)):  # a checkpoint reader
        from flaxstate.train_state import InferenceState  # the reader reads no optimizer state for it

        layout = NNXModel(model, nnx.Param if wrt is None else wrt, "nnx_update")
        template = InferenceState.create(layout.variables_of(model, "nnx_update"))
        state = source.restore(template, use_ema=use_ema)
        use_ema = False
    if state is None or not hasattr(state, "params"):
        raise TypeError(
            "nnx_update takes a Checkpoint record, a TrainState or a CheckpointFileReader; got "
            f"{type(source).__name__}."
        )
    params = state.params
    if use_ema:
        params = getattr(state, "ema", None)
        if params is None:
            raise ValueError("nnx_update(use_ema=True): the state holds no EMA; train with TrainTask(ema_decay=...).")
    variables = {PARAMS: params, **dict(state.flax_mutables or {})}
    trained = {tuple(path) for path, _ in _flatten(params)}
    frozen = {tuple(path) for path, _ in _flatten(variables.get(FROZEN_PARAMS, {}))}

    def was_trained(path: Path, variable: Any) -> bool:  # as the state says; a Param it lacks, as a Param
        key = tuple(map(_key, path))
        return key in trained or (isinstance(variable, nnx.Param) and key not in frozen)

    layout = NNXModel(model, was_trained, "nnx_update", trains=False)
    return layout.update(model, variables)


def _flatten(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, Mapping):
        return [item for key, value in tree.items() for item in _flatten(value, (*prefix, _key(key)))]
    return [(prefix, tree)]


def _dtype(variable: Any) -> Any:
    value = _value(variable)
    return value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype


def _stream_tags(rest: nnx.State) -> list[str]:
    tags = {
        leaf.tag
        for leaf in jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.RngKey))
        if isinstance(leaf, nnx.RngKey)
    }
    return sorted(tags)


def nnx_functions(model: nnx.Module) -> tuple[Callable[..., dict[str, Any]], Callable[..., Any]]:
    """Turns an NNX module into the `(init, apply)` pair of a linen module.

    `init(rngs, *inputs)` returns the module's current variables as plain
    dicts: `{"params": ..., "batch_stats": ...}` (the module was initialized
    when it was built, from its own `nnx.Rngs`). `apply(variables, *inputs,
    rngs=None, mutable=False)` runs the module in training mode when given
    rngs or mutable collections (dropout on, batch statistics updated and
    returned as `(outputs, {"batch_stats": ...})`), and in evaluation mode
    otherwise, as `TrainLoop` and `EvalLoop` call a linen module's apply.
    It takes numpy arrays (a record's) as well as jax arrays.

    Args:
        model: the NNX module.

    Returns:
        the `(init, apply)` pair.

    Example:
        >>> from flax import nnx
        >>> init, apply = nnx_functions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
        >>> sorted(init(None, None))
        ['params']
    """
    split: Any = nnx.split(model, nnx.Param, nnx.BatchStat, ...)  # (graphdef, one state per filter)
    graphdef, params, batch_stats, rest = split
    tags = _stream_tags(rest)

    def init(rngs: Any, *inputs: Any) -> dict[str, Any]:
        variables = {"params": params.to_pure_dict()}
        if batch_stats:
            variables["batch_stats"] = batch_stats.to_pure_dict()
        return variables

    def apply(
        variables: Mapping[str, Any], *inputs: Any, rngs: Mapping[str, jax.Array] | None = None, mutable: Any = False
    ) -> Any:
        # As jax arrays: NNX updates variables in place, and a record's numpy arrays are read-only.
        variables = jax.tree.map(jnp.asarray, dict(variables))
        state_params = jax.tree.map(lambda x: x, params)
        nnx.replace_by_pure_dict(state_params, variables["params"])
        state_stats = jax.tree.map(lambda x: x, batch_stats)
        if "batch_stats" in variables:
            nnx.replace_by_pure_dict(state_stats, variables["batch_stats"])
        module = nnx.merge(graphdef, state_params, state_stats, jax.tree.map(lambda x: x, rest))
        training = bool(rngs) or bool(mutable)
        if training:
            module.train()
            if rngs and tags:
                key = next(iter(rngs.values()))
                seeds: dict[str, Any] = {tag: jax.random.fold_in(key, i) for i, tag in enumerate(tags)}
                nnx.reseed(module, **seeds)
        else:
            module.eval()
        outputs = module(*inputs)
        if not mutable:
            return outputs
        _, updated = nnx.split(module, nnx.BatchStat, ...)[:2]
        return outputs, ({"batch_stats": updated.to_pure_dict()} if batch_stats else {})

    return init, apply
