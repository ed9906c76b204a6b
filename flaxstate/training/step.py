"""The per-device update and evaluation, and their mapping across devices.

The update is one per-device function of `(state, batch, rng)`: loss and
gradients, `pmean` of the gradients, the loss and the mutable collections
across all devices (of all processes), then the optax update through
`state.apply_gradient`. It is mapped over the mesh with `jax.shard_map` under
`jax.jit` (what `jax.pmap` itself is built on since JAX 0.8), with the state
donated, so the state stays one global array per leaf, replicated, that orbax
saves once and any device count restores.

A sharded loop (a mesh and logical axis rules) compiles the same function as
the global update instead: no `pmean`, no mapping, `jax.jit` with each state
leaf's sharding from its logical axes and the batch's over the batch axes
(`Sharded`); GSPMD partitions the program and inserts the collectives.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax.core.scope import CollectionFilter
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flaxstate.sharding import BatchLayout
from flaxstate.training.batching import AXIS, Batch, batch_spec, replicated

PyTree = Any


def microbatches(x: jax.Array, n_microbatches: int) -> jax.Array:
    """Splits a batch into `n_microbatches` along a new first axis, interleaved: microbatch i holds examples
    i, i + M, i + 2M, ...

    The one rule on every placement: data-parallel (each device splits its
    part of the batch) and over a mesh (GSPMD splits the global batch where
    its shards lie), the microbatches hold the same examples, so batch
    statistics and dropout masks of a run do not depend on its placement,
    and no example moves between devices.
    """
    return jnp.moveaxis(x.reshape(x.shape[0] // n_microbatches, n_microbatches, *x.shape[1:]), 1, 0)


def device_rngs(rng: jax.Array, step: jax.Array, names: Sequence[str], n_devices: int) -> dict[str, jax.Array]:
    """Returns this device's rngs for one step: one per rng collection name.

    Derived from the loop's key, the step and the device's index on the mesh,
    so a run is reproducible from its seed and masks differ per device.
    """
    device = lax.axis_index(AXIS) if n_devices > 1 else 0
    key = jax.random.fold_in(jax.random.fold_in(rng, step), device)
    return {name: jax.random.fold_in(key, position) for position, name in enumerate(names)}


def _as_tuple(outputs: Any) -> tuple[Any, ...]:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _check_scalar(value: jax.Array, what: str) -> jax.Array:
    if jnp.shape(value) != ():
        raise ValueError(
            f"{what} returned an array of shape {jnp.shape(value)}; it must return a scalar "
            "(reduce it, e.g. with .mean())."
        )
    return value


def _device_mean(tree: PyTree, n_devices: int) -> PyTree:
    """Averages floating leaves over all devices; other leaves take their maximum."""
    if n_devices == 1:
        return tree
    return jax.tree.map(
        lambda x: lax.pmean(x, AXIS) if jnp.issubdtype(x.dtype, jnp.inexact) else lax.pmax(x, AXIS), tree
    )


def _in_float32(outputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """The model's floating outputs narrower than float32 (bfloat16, float16), as float32 for the loss."""

    def widen(leaf: Any) -> Any:
        dtype = jnp.result_type(leaf)
        return leaf.astype(jnp.float32) if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4 else leaf

    return jax.tree.map(widen, outputs)


def make_train_step(
    apply: Callable[..., Any],
    loss: Callable[..., Any],
    rng_names: Sequence[str],
    mutable: CollectionFilter,
    n_devices: int,
    n_microbatches: int = 1,
) -> Callable[[PyTree, Batch, jax.Array], tuple[PyTree, PyTree, jax.Array]]:
    """Returns the per-device update `(state, batch, rng) -> (state, grads, loss)`.

    The model's floating outputs narrower than float32 reach the loss as
    float32, so a model computing in bfloat16 has its loss computed and
    averaged in float32. With `n_microbatches` M > 1 the per-device batch is
    split into M equal microbatches, interleaved: microbatch i holds examples
    i, i + M, i + 2M, ... (`microbatches`); a `lax.scan` takes
    the loss and gradients of one at a time (the activations of one
    microbatch live at a time), with the mutable collections (batch
    statistics) carried from one to the next in order, as over M smaller
    steps, and dropout rngs folded with the microbatch's index. Loss and
    gradients are their mean over the M; then one `pmean` and one update.
    With loss scaling (a state whose `loss_scale` is set), each loss is
    multiplied by the scale before its backward pass and the gradients
    divided by it after; a step whose averaged gradients are not all finite
    leaves parameters, optimizer state and mutable collections as they were
    (the step count still advances) and lowers the scale.

    With `n_devices` 1 the function is also the global update of a sharded
    loop (GSPMD partitions it).
    """

    def grads_of(
        state: PyTree, mutables: PyTree, inputs: Any, targets: Any, rngs: dict[str, jax.Array]
    ) -> tuple[tuple[jax.Array, PyTree], PyTree]:
        def loss_fn(params: PyTree) -> tuple[jax.Array, PyTree]:
            variables = {"params": params, **mutables}
            outputs, updated = apply(variables, *inputs, rngs=rngs, mutable=mutable)
            value = _check_scalar(loss(*_in_float32(_as_tuple(outputs)), *targets), "TrainTask.loss")
            return value, {name: updated[name] for name in mutables if name in updated}

        if state.loss_scale is None:
            return jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        scale = state.loss_scale.dynamic.scale

        def scaled_loss_fn(params: PyTree) -> tuple[jax.Array, tuple[jax.Array, PyTree]]:
            value, updated = loss_fn(params)
            return value.astype(jnp.float32) * scale, (value, updated)

        (_, (value, updated)), grads = jax.value_and_grad(scaled_loss_fn, has_aux=True)(state.params)
        return (value, updated), jax.tree.map(lambda g: (g / scale).astype(g.dtype), grads)

    def accumulated(
        state: PyTree, inputs: Any, targets: Any, rngs: dict[str, jax.Array]
    ) -> tuple[tuple[jax.Array, PyTree], PyTree]:
        def body(carry: tuple[Any, ...], micro: tuple[Any, ...]) -> tuple[tuple[Any, ...], None]:
            grads_sum, loss_sum, mutables = carry
            index, micro_inputs, micro_targets = micro
            micro_rngs = {name: jax.random.fold_in(key, index) for name, key in rngs.items()}
            (value, updated), grads = grads_of(state, mutables, micro_inputs, micro_targets, micro_rngs)
            grads_sum = jax.tree.map(jnp.add, grads_sum, grads)
            return (grads_sum, loss_sum + value.astype(jnp.float32), {**mutables, **updated}), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        split = functools.partial(microbatches, n_microbatches=n_microbatches)
        micro = (jnp.arange(n_microbatches), jax.tree.map(split, inputs), jax.tree.map(split, targets))
        start = (zeros, jnp.zeros((), jnp.float32), state.flax_mutables)
        (grads_sum, loss_sum, mutables), _ = lax.scan(body, start, micro)
        grads = jax.tree.map(lambda g: g / n_microbatches, grads_sum)
        return (loss_sum / n_microbatches, mutables), grads

    def train_step(state: PyTree, batch: Batch, rng: jax.Array) -> tuple[PyTree, PyTree, jax.Array]:
        inputs, targets = batch
        rngs = device_rngs(rng, state.step, rng_names, n_devices)
        if n_microbatches == 1:
            (value, mutables), grads = grads_of(state, state.flax_mutables, inputs, targets, rngs)
        else:
            (value, mutables), grads = accumulated(state, inputs, targets, rngs)
        grads, value, mutables = _device_mean((grads, value, mutables), n_devices)
        mutables = {**state.flax_mutables, **mutables}
        if state.loss_scale is None:
            return state.apply_gradient(grads, flax_mutables=mutables), grads, value
        return _update_unless_overflowed(state, grads, mutables), grads, value

    return train_step


def _update_unless_overflowed(state: PyTree, grads: PyTree, mutables: PyTree) -> PyTree:
    """The update with loss scaling: applied if every gradient is finite, else skipped; the scale follows."""
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    updated = state.apply_gradient(grads, flax_mutables=mutables)
    kept = jax.tree.map(
        lambda new, old: jnp.where(finite, new, old),
        (updated.params, updated.param_states, updated.flax_mutables),
        (state.params, state.param_states, state.flax_mutables),
    )
    params, param_states, flax_mutables = kept
    return updated.replace(
        params=params,
        param_states=param_states,
        flax_mutables=flax_mutables,
        loss_scale=state.loss_scale.after(finite),
    )


def make_eval_step(
    apply: Callable[..., Any],
    metrics: Mapping[str, Callable[..., Any]],
    rng_names: Sequence[str],
    n_devices: int,
    rng_impl: Any = None,
) -> Callable[[PyTree, Batch, jax.Array], dict[str, jax.Array]]:
    """Returns the per-device evaluation `(state, batch, rng_data) -> {name: mean over devices}`.

    The model gets rngs only for `rng_names` (none: no rngs at all).
    """

    def eval_step(state: PyTree, batch: Batch, rng_data: jax.Array) -> dict[str, jax.Array]:
        inputs, targets = batch
        variables = {"params": state.params, **state.flax_mutables}
        if rng_names:
            rngs = device_rngs(jax.random.wrap_key_data(rng_data, impl=rng_impl), state.step, rng_names, n_devices)
            outputs = _as_tuple(apply(variables, *inputs, rngs=rngs))
        else:
            outputs = _as_tuple(apply(variables, *inputs))
        values = {  # every metric averaged as a number, integer ones too (never the maximum)
            name: _check_scalar(metric(*outputs, *targets), f"EvalTask.metrics[{name!r}]").astype(jnp.float32)
            for name, metric in metrics.items()
        }
        return _device_mean(values, n_devices)

    return eval_step


def _rebuild(treedef: Any, leaves: list[jax.Array], rng_impl: Any, rng_data: jax.Array) -> tuple[PyTree, jax.Array]:
    """The state and the key inside a compiled call, from the flat leaves and raw key data it was given."""
    return jax.tree.unflatten(treedef, leaves), jax.random.wrap_key_data(rng_data, impl=rng_impl)


@dataclasses.dataclass(frozen=True)
class Sharded:
    """Where a sharded loop's arrays live: each state leaf, the gradients (their parameter's), the batch.

    Attributes:
        state: one sharding per leaf of the state, in `jax.tree.leaves` order.
        params: the shardings of the parameters' tree (the gradients').
        batch: the batch's layout.
    """

    state: list[NamedSharding]
    params: PyTree
    batch: BatchLayout

    @property
    def replicated(self) -> NamedSharding:
        return replicated(self.batch.mesh)


def compile_train_steps(
    train_step: Callable[..., tuple[PyTree, PyTree, jax.Array]],
    mesh: Mesh,
    n_steps: int,
    treedef: Any,
    rng_impl: Any,
    sharded: Sharded | None = None,
) -> Callable[..., tuple[Any, ...]]:
    """Maps `n_steps` updates in one compiled call over the mesh, the state donated.

    The call is `(state_leaves, batch, rng_data) -> (state_leaves, loss)` for
    one step, and `(state_leaves, batches, rng_data) -> (state_leaves, grads,
    losses)` for several (a `lax.scan`; `grads` are the last step's, `losses`
    has shape `(n_steps,)`). The state travels as its flat list of leaves
    (`treedef` rebuilds it inside) and the key as its raw data (`rng_impl`
    rewraps it), which keeps the per-step dispatch in JAX's C++ path, off
    Python's pytree flattening. A single step returns no gradients: they
    would be one more output buffer per parameter every step, and a record
    computes its last step's with `compile_gradients` instead; every step
    still runs the one same XLA program, so where records fall never moves
    a result by an ulp.

    Without `sharded`, `train_step` is per device and mapped with
    `shard_map` (the state replicated); with it, `train_step` is the global
    update, compiled with `jax.jit` and these explicit shardings (GSPMD
    inserts the collectives).
    """

    if n_steps == 1:

        def steps(state: PyTree, batch: Batch, rng: jax.Array) -> tuple[Any, ...]:
            state, _, loss = train_step(state, batch, rng)
            return state, loss

    else:

        def steps(state: PyTree, batches: Batch, rng: jax.Array) -> tuple[Any, ...]:
            def body(carry: tuple[Any, ...], batch: Batch) -> tuple[tuple[Any, ...], jax.Array]:
                state, grads, loss = train_step(carry[0], batch, rng)
                return (state, grads), loss.astype(jnp.float32)

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            (state, grads), losses = lax.scan(body, (state, zeros), batches, length=n_steps)
            return state, grads, losses

    def flat_steps(leaves: list[jax.Array], batches: Batch, rng_data: jax.Array) -> tuple[Any, ...]:
        state, rng = _rebuild(treedef, leaves, rng_impl, rng_data)
        state, *outputs = steps(state, batches, rng)
        return jax.tree.leaves(state), *outputs

    if sharded is not None:
        outputs = (sharded.replicated,) if n_steps == 1 else (sharded.params, sharded.replicated)
        return _jit_sharded(sharded.state, sharded.batch, flat_steps, n_steps > 1, (sharded.state, *outputs), (0,))
    return _map_over(mesh, flat_steps, in_specs=(batch_spec(n_steps > 1), PartitionSpec()), donate=(0,))


def compile_gradients(
    train_step: Callable[..., tuple[PyTree, PyTree, jax.Array]],
    mesh: Mesh,
    treedef: Any,
    rng_impl: Any,
    sharded: Sharded | None = None,
) -> Callable[..., PyTree]:
    """Maps `(state_leaves, batch, rng_data) -> grads` of one step (nothing donated) over the mesh.

    The gradients that the update of that state on that batch applies (the
    same function; XLA drops the update itself), sharded as their
    parameters under `sharded`.
    """

    def gradients(leaves: list[jax.Array], batch: Batch, rng_data: jax.Array) -> PyTree:
        state, rng = _rebuild(treedef, leaves, rng_impl, rng_data)
        return train_step(state, batch, rng)[1]

    if sharded is not None:
        return _jit_sharded(sharded.state, sharded.batch, gradients, False, sharded.params, donate=())
    return _map_over(mesh, gradients, in_specs=(batch_spec(False), PartitionSpec()), donate=())


def _jit_sharded(
    state_shardings: PyTree,
    layout: BatchLayout,
    function: Callable[..., Any],
    stacked: bool,
    out_shardings: Any,
    donate: tuple[int, ...],
) -> Callable[..., Any]:
    """Compiles a global `function(state, batch, rng_data)` with explicit shardings (GSPMD).

    The state's shardings match what the function takes: the update's flat
    list of leaves, or the evaluation's state tree.
    """
    in_shardings = (state_shardings, layout.sharding(stacked), replicated(layout.mesh))
    return jax.jit(function, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate)


def _map_over(
    mesh: Mesh, per_device: Callable[..., Any], in_specs: tuple[PartitionSpec, ...], donate: tuple[int, ...]
) -> Callable[..., Any]:
    """Compiles `per_device(state, *rest)` over the mesh: the state and outputs replicated.

    The compiled call states where its inputs live, so it takes host arrays
    (placed by the call itself, the fastest path on a CPU) as well as arrays
    already on the devices. On a single device the function is compiled as
    it is: no collective is needed, and the update is the XLA program a
    hand-written jit loop runs.
    """
    replicated = PartitionSpec()
    in_shardings = tuple(NamedSharding(mesh, spec) for spec in (replicated, *in_specs))
    if mesh.size == 1:
        return jax.jit(per_device, in_shardings=in_shardings, donate_argnums=donate)
    mapped = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(replicated, *in_specs),
        out_specs=replicated,
        # Per-device gradients as under pmap: with check_vma, the gradient of a replicated
        # parameter would already be summed over devices before our explicit pmean.
        check_vma=False,
    )
    return jax.jit(mapped, in_shardings=in_shardings, donate_argnums=donate)


def compile_eval_step(eval_step: Callable[..., dict[str, jax.Array]], mesh: Mesh) -> Callable[..., Any]:
    """Maps the evaluation over the mesh (nothing donated: the state is the record's)."""
    return _map_over(mesh, eval_step, in_specs=(batch_spec(False), PartitionSpec()), donate=())


def compile_sharded_eval_step(
    eval_step: Callable[..., dict[str, jax.Array]], state_shardings: PyTree, layout: BatchLayout
) -> Callable[..., Any]:
    """Compiles a global evaluation (`make_eval_step(n_devices=1)`) with the state's and the batch's shardings.

    GSPMD partitions it as it does the sharded update; the metrics come back
    replicated, and nothing is donated.
    """
    return _jit_sharded(state_shardings, layout, eval_step, False, replicated(layout.mesh), donate=())
