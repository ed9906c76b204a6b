"""The train state: parameters, optimizer state and mutable collections, immutable.

After T5X's `train_state.py`, on optax instead of T5X's optimizer wrappers.
`FlaxOptimTrainState` holds what a training step changes; `InferenceState`
holds what a forward pass needs. Both share the `TrainState` protocol and the
`state_dict()` layout that checkpoints store::

    {"target": params,
     "state": {"step": step, "param_states": optimizer state},
     "flax_mutables": {collection: variables}}
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization, struct
from flax.core import FrozenDict
from flax.linen import partitioning
from jax.sharding import PartitionSpec

from flaxstate import tree_paths

PyTree = Any
_AXES_SUFFIX = "_axes"


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()


class StateMismatchError(ValueError):
    """A state dict (or checkpoint) whose tree differs from the state's own."""


@runtime_checkable
class TrainState(Protocol):
    """What a checkpoint needs of a state, as in T5X: the interface both states share.

    Readers restore any state that implements it (`FlaxOptimTrainState`, and
    `InferenceState`, whose `param_states` is `None`); `TrainLoop` trains a
    `FlaxOptimTrainState`. `isinstance(state, TrainState)` checks the names
    only, as `typing.runtime_checkable` does.
    """

    step: jax.Array
    params: PyTree
    flax_mutables: PyTree

    @property
    def param_states(self) -> PyTree: ...

    def state_dict(self) -> dict[str, Any]: ...

    def restore_state(self, state_dict: Mapping[str, Any], strict: bool = True) -> TrainState: ...

    def replace_params(self, params: PyTree) -> TrainState: ...

    def replace_step(self, step: jax.Array | int) -> TrainState: ...

    def apply_gradient(
        self, grads: PyTree, learning_rate: float | jax.Array | None = None, flax_mutables: PyTree = _UNSET
    ) -> TrainState: ...

    def as_logical_axes(self) -> TrainState: ...


TRAINING_ONLY = ("param_states", "loss_scale", "ema")
"""The entries of a state dict's `state` that only a training state holds (an `InferenceState` has none)."""


def is_training(state_dict: Mapping[str, Any]) -> bool:
    """Whether a state dict is a training state's (it holds the optimizer's state), not an inference state's."""
    return "param_states" in state_dict["state"]


def _plain(tree: PyTree) -> PyTree:
    """Nested plain dicts: FrozenDicts thawed, optax NamedTuples as dicts."""
    return serialization.to_state_dict(flax.core.unfreeze(tree))


def _split_variables(model_variables: Mapping[str, Any]) -> tuple[PyTree, dict[str, Any], dict[str, Any]]:
    """Splits linen variables into params, the other collections, and `*_axes` collections."""
    variables = flax.core.unfreeze(dict(model_variables))
    if "params" not in variables:
        raise ValueError(
            f"model_variables has no 'params' collection (found {sorted(variables)}); "
            "pass what a linen module's init returns, e.g. model.init(rng, x)."
        )
    axes = {name: value for name, value in variables.items() if name.endswith(_AXES_SUFFIX)}
    collections = {name: value for name, value in variables.items() if not name.endswith(_AXES_SUFFIX)}
    params = collections.pop("params")
    return params, collections, axes


def _logical_axes(collection: PyTree, axes_collection: PyTree | None, name: str) -> FrozenDict | None:
    """Unboxes a collection's axis names: boxed metadata and T5X `*_axes` entries.

    Returns `None` when the collection carries no axis names at all; raises a
    `ValueError` naming the paths without axes when only some do.
    """
    specs: dict[str, PartitionSpec] = {}
    for path, leaf in tree_paths.flatten(
        collection, is_leaf=lambda x: isinstance(x, flax.linen.meta.AxisMetadata)
    ).items():
        if isinstance(leaf, flax.linen.LogicallyPartitioned):
            specs[path] = PartitionSpec(*leaf.names)
        elif isinstance(leaf, flax.linen.meta.AxisMetadata):
            boxed: Any = leaf  # a partitioned box (e.g. nnx's) that names its axes
            specs[path] = PartitionSpec(*boxed.get_partition_spec())
    if axes_collection:
        names = flax.core.unfreeze(partitioning.get_axis_names(axes_collection))
        specs.update(tree_paths.flatten(names))
    if not specs:
        return None
    params = tree_paths.flatten(flax.linen.meta.unbox(collection))
    missing = sorted(params.keys() - specs.keys())
    if missing:
        raise ValueError(
            f"the model gives logical axis names for some of '{name}' but not for: "
            + ", ".join(missing)
            + ". Give every variable axis names (nn.with_logical_partitioning or "
            "partitioning.param_with_axes), or none."
        )
    return FrozenDict(tree_paths.unflatten({path: specs[path] for path in params}))


def _axes_error(state_name: str) -> ValueError:
    return ValueError(
        f"{state_name}.as_logical_axes(): the model gave no logical axis names. Build its "
        "variables with nn.with_logical_partitioning(...) or flax.linen.partitioning."
        "param_with_axes(...), then create the state from those variables."
    )


def _check_and_merge(
    current: dict[str, Any], given: Mapping[str, Any], strict: bool, state_name: str
) -> dict[str, Any]:
    """Checks a state dict against the current one and returns the merged flat dict."""
    expected = tree_paths.flatten(current)
    found = _step_as_int32(tree_paths.flatten(_plain(given)))
    difference = tree_paths.diff(expected, found)
    if not strict:
        difference = tree_paths.StructureDiff(unexpected=difference.unexpected, mismatched=difference.mismatched)
    if difference:
        raise StateMismatchError(
            f"{state_name}.restore_state: the state dict does not match this state's tree:\n"
            + difference.describe()
            + "\nRestore into a model with the same variables, map old paths to new "
            "ones (a reader's rename=), or restore a subtree with strict=False."
        )
    merged = dict(expected)
    merged.update(found)
    return merged


_STEP = "state/step"


def _step_as_int32(found: dict[str, Any]) -> dict[str, Any]:
    """The state dict's step as int32 where it is any integer scalar (a Python int, int64, ...).

    The step is a counter, not a model variable: T5X and `replace_step`
    accept any integer for it, and the state stores it as int32. A step of
    another kind (a float, an array) is left for the dtype check to name.
    """
    step = found.get(_STEP)
    if step is None or isinstance(step, bool | jax.ShapeDtypeStruct) or np.shape(step) != ():
        return found
    dtype = step.dtype if hasattr(step, "dtype") else np.asarray(step).dtype
    if not np.issubdtype(dtype, np.integer) or dtype == np.int32:
        return found
    if isinstance(step, jax.Array):
        return {**found, _STEP: step.astype(jnp.int32)}
    if not np.iinfo(np.int32).min <= int(step) <= np.iinfo(np.int32).max:
        raise StateMismatchError(f"state/step is {int(step)}, which does not fit the state's int32 step counter.")
    return {**found, _STEP: np.int32(step)}


def _restore_leaves(template: PyTree, merged: Mapping[str, Any]) -> PyTree:
    """Puts the merged leaves into the template's tree, keeping its leaves' dtypes."""

    def pick(key_path: Any, leaf: Any) -> Any:
        return jnp.asarray(merged[tree_paths.path_name(key_path)], dtype=leaf.dtype)

    return jax.tree_util.tree_map_with_path(pick, template)


class _ReplaceMethods:
    """`replace_params` and `replace_step`, shared by both states (flax structs with `replace`)."""

    def replace_params(self, params: PyTree) -> Any:
        """Returns the state with other params (same tree)."""
        return self.replace(params=params)  # type: ignore[attr-defined]

    def replace_step(self, step: jax.Array | int) -> Any:
        """Returns the state at another step."""
        return self.replace(step=jnp.asarray(step, dtype=jnp.int32))  # type: ignore[attr-defined]


class FlaxOptimTrainState(_ReplaceMethods, struct.PyTreeNode):
    """An immutable train state: step, params, optax state and mutable collections.

    Example:
        >>> import flax.linen as nn, jax, jax.numpy as jnp, optax
        >>> variables = nn.Dense(2).init(jax.random.key(0), jnp.ones((1, 3)))
        >>> state = FlaxOptimTrainState.create(optax.sgd(0.1), variables)
        >>> grads = jax.tree.map(jnp.ones_like, state.params)
        >>> int(state.apply_gradient(grads).step)
        1
    """

    step: jax.Array
    params: PyTree
    param_states: PyTree
    flax_mutables: PyTree
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    params_axes: FrozenDict | None = struct.field(pytree_node=False, default=None)
    flax_mutables_axes: FrozenDict | None = struct.field(pytree_node=False, default=None)
    loss_scale: PyTree = None
    """Dynamic loss scaling's state (`flaxstate.training.scaling.LossScale`), or None without it."""
    ema: PyTree = None
    """The exponential moving average of `params` (float32), or None without it."""
    ema_decay: Any = struct.field(pytree_node=False, default=None)
    """The EMA's decay: a float, or a schedule of the step (optax-style); None without an EMA."""

    @classmethod
    def create(
        cls,
        tx: optax.GradientTransformation,
        model_variables: Mapping[str, Any],
        loss_scale: PyTree = None,
        ema_decay: float | Callable[[jax.Array], jax.Array] | None = None,
    ) -> FlaxOptimTrainState:
        """Creates a state at step 0 from a linen module's variables.

        Args:
            tx: the optax optimizer.
            model_variables: what `module.init` returns (a dict or FrozenDict):
                `params`, other collections (e.g. `batch_stats`), and optional
                `*_axes` collections or boxed logical axis metadata.
            loss_scale: dynamic loss scaling's state, saved with the optimizer
                state (under `state/loss_scale`); None without loss scaling.
            ema_decay: keep an exponential moving average of the parameters
                (`ema`, float32, starting at the initial parameters, saved
                under `state/ema`) with this decay, a float or a schedule of
                the step; None: no EMA.

        Returns:
            the state, with `tx.init(params)` as the optimizer state.

        Raises:
            ValueError: no `params` collection, or axis names missing for some paths.
        """
        params, collections, axes = _split_variables(model_variables)
        params_axes = _logical_axes(params, axes.get("params" + _AXES_SUFFIX), "params")
        mutables_axes = {
            name: _logical_axes(value, axes.get(name + _AXES_SUFFIX), name) for name, value in collections.items()
        }
        params = flax.linen.meta.unbox(params)
        collections = flax.linen.meta.unbox(collections)
        return cls(
            step=jnp.asarray(0, dtype=jnp.int32),
            params=params,
            param_states=tx.init(params),
            flax_mutables=collections,
            tx=tx,
            params_axes=params_axes,
            flax_mutables_axes=FrozenDict(mutables_axes)
            if any(v is not None for v in mutables_axes.values())
            else None,
            loss_scale=loss_scale,
            ema=None if ema_decay is None else jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params),
            ema_decay=ema_decay,
        )

    def apply_gradient(
        self, grads: PyTree, learning_rate: float | jax.Array | None = None, flax_mutables: PyTree = _UNSET
    ) -> FlaxOptimTrainState:
        """Applies one optimizer update and returns the next state (step + 1).

        Args:
            grads: gradients with the tree of `params`.
            learning_rate: a rate for this update; needs an optimizer built
                with `optax.inject_hyperparams`.
            flax_mutables: new mutable collections (e.g. batch statistics);
                unchanged when not given.

        Returns:
            the new state.

        Raises:
            ValueError: `learning_rate` given, but the optimizer has no
                injected `learning_rate` hyperparameter.
        """
        opt_state = self.param_states
        if learning_rate is not None:
            current = optax.tree_utils.tree_get(opt_state, "learning_rate", default=None)
            if current is None:
                raise ValueError(
                    "apply_gradient(learning_rate=...) needs an optimizer whose learning rate is a "
                    "hyperparameter of its state; build it with optax.inject_hyperparams, e.g. "
                    "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)."
                )
            opt_state = optax.tree_utils.tree_set(
                opt_state, learning_rate=jnp.asarray(learning_rate, dtype=jnp.asarray(current).dtype)
            )
        updates, opt_state = self.tx.update(grads, opt_state, self.params)
        params = optax.apply_updates(self.params, updates)
        return self.replace(
            step=self.step + 1,
            params=params,
            param_states=opt_state,
            flax_mutables=self.flax_mutables if flax_mutables is _UNSET else flax_mutables,
            ema=self._next_ema(params),
        )

    def _next_ema(self, params: PyTree) -> PyTree:
        """The EMA after an update to `params`: `decay * ema + (1 - decay) * params`, in float32."""
        if self.ema is None:
            return None
        decay = self.ema_decay(self.step) if callable(self.ema_decay) else self.ema_decay
        decay = jnp.asarray(decay, jnp.float32)
        return jax.tree.map(lambda average, p: decay * average + (1 - decay) * p.astype(jnp.float32), self.ema, params)

    def state_dict(self) -> dict[str, Any]:
        """Returns the state as plain nested dicts in the checkpoint layout."""
        state = {"step": self.step, "param_states": _plain(self.param_states)}
        if self.loss_scale is not None:
            state["loss_scale"] = _plain(self.loss_scale)
        if self.ema is not None:
            state["ema"] = _plain(self.ema)
        return {"target": _plain(self.params), "state": state, "flax_mutables": _plain(self.flax_mutables)}

    def restore_state(self, state_dict: Mapping[str, Any], strict: bool = True) -> FlaxOptimTrainState:
        """Returns a state with the values of `state_dict`, checked against this one.

        Args:
            state_dict: the layout `state_dict()` returns.
            strict: require every path; `False` restores the paths given
                (e.g. only `target`) and keeps the rest.

        Returns:
            the restored state.

        Raises:
            StateMismatchError: one error listing every missing, unexpected
                and shape- or dtype-mismatched path.
        """
        current = self.state_dict()
        merged = _check_and_merge(current, state_dict, strict, type(self).__name__)
        restored = _restore_leaves(current, merged)
        return self.replace(
            step=restored["state"]["step"],
            params=serialization.from_state_dict(self.params, restored["target"]),
            param_states=serialization.from_state_dict(self.param_states, restored["state"]["param_states"]),
            flax_mutables=serialization.from_state_dict(self.flax_mutables, restored["flax_mutables"]),
            loss_scale=None
            if self.loss_scale is None
            else serialization.from_state_dict(self.loss_scale, restored["state"]["loss_scale"]),
            ema=None if self.ema is None else serialization.from_state_dict(self.ema, restored["state"]["ema"]),
        )

    def as_logical_axes(self) -> FlaxOptimTrainState:
        """Returns the state with a `PartitionSpec` of logical axis names per leaf.

        Optimizer-state leaves shaped like their parameter get that
        parameter's names (as T5X's optimizers did); scalars such as a step
        count get `P()`. A factored statistic (adafactor's `v_row` of a
        kernel, which drops one of its dimensions) keeps the names of the
        dimensions it keeps, where its shape says which those are; where it
        does not (a square kernel) or it matches no part of the parameter's
        shape (a placeholder of shape `(1,)`), it is replicated: `P()`.

        Raises:
            ValueError: the model gave no axis names.
        """
        if self.params_axes is None:
            raise _axes_error(type(self).__name__)
        params_axes = flax.core.unfreeze(self.params_axes)
        opt_axes = optax.tree_map_params(
            self.tx,
            _statistic_axes,
            self.param_states,
            params_axes,
            self.params,
            transform_non_params=lambda _: PartitionSpec(),
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )
        return self.replace(
            step=PartitionSpec(),
            params=params_axes,
            param_states=opt_axes,
            flax_mutables=_mutables_axes(self.flax_mutables, self.flax_mutables_axes),
            loss_scale=jax.tree.map(lambda _: PartitionSpec(), self.loss_scale),
            ema=None if self.ema is None else params_axes,
        )


def _statistic_axes(statistic: Any, axes: PartitionSpec, param: Any) -> PartitionSpec:
    """The logical axes of an optimizer statistic of `param` (whose axes are `axes`); see `as_logical_axes`."""
    shape, param_shape = tuple(np.shape(statistic)), tuple(np.shape(param))
    names = tuple(axes) + (None,) * (len(param_shape) - len(axes))
    if shape == param_shape:
        return axes
    kept = {
        tuple(names[dimension] for dimension in dimensions)
        for dimensions in itertools.combinations(range(len(param_shape)), len(shape))
        if tuple(param_shape[dimension] for dimension in dimensions) == shape
    }
    return PartitionSpec(*kept.pop()) if len(kept) == 1 else PartitionSpec()


def _mutables_axes(flax_mutables: PyTree, axes: FrozenDict | None) -> PyTree:
    names: dict[str, Any] = flax.core.unfreeze(axes) if axes is not None else {}
    return {
        name: names[name] if names.get(name) is not None else jax.tree.map(lambda _: PartitionSpec(), value)
        for name, value in flax.core.unfreeze(flax_mutables).items()
    }


class InferenceState(_ReplaceMethods, struct.PyTreeNode):
    """A state for inference: step, params and mutable collections, no optimizer.

    Restores from a training state dict (or checkpoint) and ignores its
    optimizer state.

    Example:
        >>> import flax.linen as nn, jax, jax.numpy as jnp
        >>> variables = nn.Dense(2).init(jax.random.key(0), jnp.ones((1, 3)))
        >>> state = InferenceState.create(variables)
        >>> sorted(state.state_dict())
        ['flax_mutables', 'state', 'target']
    """

    step: jax.Array
    params: PyTree
    flax_mutables: PyTree
    params_axes: FrozenDict | None = struct.field(pytree_node=False, default=None)
    flax_mutables_axes: FrozenDict | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, model_variables: Mapping[str, Any]) -> InferenceState:
        """Creates an inference state at step 0 from a linen module's variables.

        Args:
            model_variables: what `module.init` returns.

        Returns:
            the state.

        Raises:
            ValueError: no `params` collection, or axis names missing for some paths.
        """
        state = FlaxOptimTrainState.create(optax.identity(), model_variables)
        return cls(
            step=state.step,
            params=state.params,
            flax_mutables=state.flax_mutables,
            params_axes=state.params_axes,
            flax_mutables_axes=state.flax_mutables_axes,
        )

    @property
    def param_states(self) -> None:
        """`None`: an inference state holds no optimizer state."""
        return None

    def apply_gradient(
        self, grads: PyTree, learning_rate: float | jax.Array | None = None, flax_mutables: PyTree = _UNSET
    ) -> InferenceState:
        """Raises: an inference state cannot be trained."""
        raise NotImplementedError(
            "InferenceState.apply_gradient: an inference state holds no optimizer; train a FlaxOptimTrainState instead."
        )

    def state_dict(self) -> dict[str, Any]:
        """Returns the state in the checkpoint layout, without `param_states`."""
        return {
            "target": _plain(self.params),
            "state": {"step": self.step},
            "flax_mutables": _plain(self.flax_mutables),
        }

    def restore_state(self, state_dict: Mapping[str, Any], strict: bool = True) -> InferenceState:
        """Returns a state with the values of `state_dict`; optimizer state and loss scale are ignored.

        Args:
            state_dict: an inference or a training state dict.
            strict: require every path (`param_states`, `loss_scale` and
                `ema` are never required).

        Returns:
            the restored state.

        Raises:
            StateMismatchError: one error listing every differing path.
        """
        state_dict = dict(state_dict)
        if "state" in state_dict:
            state_dict["state"] = {k: v for k, v in state_dict["state"].items() if k not in TRAINING_ONLY}
        current = self.state_dict()
        merged = _check_and_merge(current, state_dict, strict, type(self).__name__)
        restored = _restore_leaves(current, merged)
        return self.replace(
            step=restored["state"]["step"],
            params=serialization.from_state_dict(self.params, restored["target"]),
            flax_mutables=serialization.from_state_dict(self.flax_mutables, restored["flax_mutables"]),
        )

    def as_logical_axes(self) -> InferenceState:
        """Returns the state with a `PartitionSpec` of logical axis names per leaf.

        Raises:
            ValueError: the model gave no axis names.
        """
        if self.params_axes is None:
            raise _axes_error(type(self).__name__)
        return self.replace(
            step=PartitionSpec(),
            params=flax.core.unfreeze(self.params_axes),
            flax_mutables=_mutables_axes(self.flax_mutables, self.flax_mutables_axes),
        )
