"""The update and the evaluation as pure functions of `(state, batch, rng)`, and the programs made of them.

The update is one function: loss and gradients (over M microbatches, with
loss scaling when the state has it), their mean over the devices, the mutable
collections', then the optax update through `state.apply_gradient`. It has no
mode: where it runs (`flaxstate.training.placement`) hands it an `Across`,
which tells devices apart and averages over them (per device under
`shard_map`, `pmean` across the devices; the identity for the global update
that GSPMD partitions), and compiles the programs built here:
`update_program` (K steps in one call, a record's with its last step's
gradients).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax.core.scope import CollectionFilter
from jax import lax

from flaxstate.run_record import fingerprints
from flaxstate.training.batching import Batch
from flaxstate.training.placement import Across

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


def device_rngs(rng: jax.Array, step: jax.Array, names: Sequence[str], across: Across) -> dict[str, jax.Array]:
    """Returns this device's rngs for one step: one per rng collection name.

    Derived from the loop's key, the step and the device's index on the mesh
    (0 for a global update), so a run is reproducible from its seed and masks
    differ per device.
    """
    key = jax.random.fold_in(jax.random.fold_in(rng, step), across.index())
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


def _in_float32(outputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """The model's floating outputs narrower than float32 (bfloat16, float16), as float32 for the loss."""

    def widen(leaf: Any) -> Any:
        dtype = jnp.result_type(leaf)
        return leaf.astype(jnp.float32) if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4 else leaf

    return jax.tree.map(widen, outputs)


GradientFunction = Callable[..., tuple[tuple[jax.Array, PyTree], PyTree]]
"""`(state, mutables, inputs, targets, rngs) -> ((loss, updated mutables), grads)` of one batch."""


def loss_gradients(apply: Callable[..., Any], loss: Callable[..., Any], mutable: CollectionFilter) -> GradientFunction:
    """Returns the loss and gradients of a batch with respect to `state.params` (a `GradientFunction`).

    The model's floating outputs narrower than float32 reach the loss as
    float32. With loss scaling (a state whose `loss_scale` is set), the loss
    is multiplied by the scale before its backward pass and the gradients
    divided by it after.
    """

    def gradients(
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

    return gradients


def microbatched(gradients: GradientFunction, n_microbatches: int, unrolled: bool = False) -> GradientFunction:
    """Returns `gradients` accumulated over `n_microbatches` microbatches of the batch (as Levanter's `microbatched`).

    The batch is split into M equal microbatches, interleaved (`microbatches`);
    a `lax.scan` takes the loss and gradients of one at a time (the
    activations of one microbatch live at a time), with the mutable
    collections (batch statistics) carried from one to the next in order, as
    over M smaller steps, and dropout rngs folded with the microbatch's
    index. Loss and gradients are their mean over the M. M = 1 is
    `gradients` itself. `unrolled` writes the M bodies out, for XLA's cost
    analysis, which counts a loop's body once (never to run: M microbatches'
    activations would live at once).
    """
    if n_microbatches == 1:
        return gradients

    def accumulated(
        state: PyTree, mutables: PyTree, inputs: Any, targets: Any, rngs: dict[str, jax.Array]
    ) -> tuple[tuple[jax.Array, PyTree], PyTree]:
        def body(carry: tuple[Any, ...], micro: tuple[Any, ...]) -> tuple[tuple[Any, ...], None]:
            grads_sum, loss_sum, mutables = carry
            index, micro_inputs, micro_targets = micro
            micro_rngs = {name: jax.random.fold_in(key, index) for name, key in rngs.items()}
            (value, updated), grads = gradients(state, mutables, micro_inputs, micro_targets, micro_rngs)
            grads_sum = jax.tree.map(jnp.add, grads_sum, grads)
            return (grads_sum, loss_sum + value.astype(jnp.float32), {**mutables, **updated}), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        split = functools.partial(microbatches, n_microbatches=n_microbatches)
        micro = (jnp.arange(n_microbatches), jax.tree.map(split, inputs), jax.tree.map(split, targets))
        start = (zeros, jnp.zeros((), jnp.float32), mutables)
        (grads_sum, loss_sum, mutables), _ = lax.scan(body, start, micro, unroll=n_microbatches if unrolled else 1)
        grads = jax.tree.map(lambda g: g / n_microbatches, grads_sum)
        return (loss_sum / n_microbatches, mutables), grads

    return accumulated


def make_train_step(
    apply: Callable[..., Any],
    loss: Callable[..., Any],
    *,
    rng_names: Sequence[str],
    mutable: CollectionFilter,
    across: Across,
    n_microbatches: int = 1,
    fenced: bool = False,
    unrolled: bool = False,
) -> Callable[[PyTree, Batch, jax.Array], tuple[PyTree, PyTree, jax.Array]]:
    """Returns the per-device update `(state, batch, rng) -> (state, grads, loss)`.

    `fenced` puts the averaged gradients behind `lax.optimization_barrier`,
    for the loop's updates: XLA then computes them alike in the program that
    returns them (a record's) and the one that does not, where it otherwise
    fuses them into the update differently (the digits example resumed at
    step 20 ended a few ulps, amplified by adam to 1e-4, away from an
    uninterrupted run). Unfenced, one step is the program a hand-written
    jit loop runs.
    `unrolled`: the microbatches' loop written out (`microbatched`), a step
    to count FLOPs of, not to run.

    The loss and gradients of the batch (`loss_gradients`, over M
    microbatches with `microbatched`), their mean over the devices with the
    mutable collections' (`across` is the placement's: per device, averaged
    over the devices; globally, not at all), then one update. With loss
    scaling, a step whose averaged gradients are not all finite leaves
    parameters, optimizer state, mutable collections and the EMA as they were
    (the step count still advances) and lowers the scale.
    """
    gradients = microbatched(loss_gradients(apply, loss, mutable), n_microbatches, unrolled)

    def train_step(state: PyTree, batch: Batch, rng: jax.Array) -> tuple[PyTree, PyTree, jax.Array]:
        inputs, targets = batch
        rngs = device_rngs(rng, state.step, rng_names, across)
        (value, mutables), grads = gradients(state, state.flax_mutables, inputs, targets, rngs)
        grads, value, mutables = across.mean((grads, value, mutables))
        if fenced:
            grads = lax.optimization_barrier(grads)
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
        (updated.params, updated.param_states, updated.flax_mutables, updated.ema),
        (state.params, state.param_states, state.flax_mutables, state.ema),
    )
    params, param_states, flax_mutables, ema = kept
    return updated.replace(
        params=params,
        param_states=param_states,
        flax_mutables=flax_mutables,
        ema=ema,
        loss_scale=state.loss_scale.after(finite),
    )


def make_eval_step(
    apply: Callable[..., Any],
    metrics: Mapping[str, Callable[..., Any]],
    rng_names: Sequence[str],
    across: Across,
    rng_impl: Any = None,
) -> Callable[[PyTree, Batch, jax.Array], dict[str, jax.Array]]:
    """Returns the per-device evaluation `(state, batch, rng_data) -> {name: mean over devices}`.

    The model gets rngs only for `rng_names` (none: no rngs at all).
    """

    def eval_step(state: PyTree, batch: Batch, rng_data: jax.Array) -> dict[str, jax.Array]:
        inputs, targets = batch
        variables = {"params": state.params, **state.flax_mutables}
        if rng_names:
            rngs = device_rngs(jax.random.wrap_key_data(rng_data, impl=rng_impl), state.step, rng_names, across)
            outputs = _as_tuple(apply(variables, *inputs, rngs=rngs))
        else:
            outputs = _as_tuple(apply(variables, *inputs))
        values = {  # every metric averaged as a number, integer ones too (never the maximum)
            name: _check_scalar(metric(*outputs, *targets), f"EvalTask.metrics[{name!r}]").astype(jnp.float32)
            for name, metric in metrics.items()
        }
        return across.mean(values)

    return eval_step


def _rebuild(treedef: Any, leaves: list[jax.Array], rng_impl: Any, rng_data: jax.Array) -> tuple[PyTree, jax.Array]:
    """The state and the key inside a compiled call, from the flat leaves and raw key data it was given."""
    return jax.tree.unflatten(treedef, leaves), jax.random.wrap_key_data(rng_data, impl=rng_impl)


def update_program(
    train_step: Callable[..., tuple[PyTree, PyTree, jax.Array]],
    n_steps: int,
    treedef: Any,
    rng_impl: Any,
    gradients: bool = False,
    fingerprinted: bool = False,
) -> Callable[..., tuple[Any, ...]]:
    """Returns `(state_leaves, batches, rng_data) -> (state_leaves, losses)`: `n_steps` updates in one call.

    One output structure whatever K: `losses` has shape `(n_steps,)`, and
    K > 1 is a `lax.scan` over K stacked batches. With `gradients` it also
    returns the last step's (carried through the scan at K > 1): a record's
    dispatch runs it, every other runs the update without (carried through
    every scan, they cost a small MLP's step 2% here). Given a `fenced` train
    step (`make_train_step`), the two give the same state bit for bit,
    wherever records fall. A record of one step so costs one forward and
    backward pass, as any step: a program of the gradients alone, beside
    the update, cost a compute-bound step's record a second pass. With
    `fingerprinted` too, the record's dispatch also returns its state's
    fingerprint (`flaxstate.run_record.fingerprints`), computed after the
    steps (so nothing of it joins the steps' kernels): on this project's CPUs
    a separate call for it, made once a record with the host's caches cold
    from the steps, cost several times as much. The state travels as its
    flat list of leaves (`treedef` rebuilds it inside) and the key as its
    raw data (`rng_impl` rewraps it), which keeps the per-step dispatch in
    JAX's C++ path, off Python's pytree flattening.
    """

    def steps(state: PyTree, batches: Batch, rng: jax.Array) -> tuple[Any, ...]:
        if n_steps == 1:
            state, step_grads, loss = train_step(state, batches, rng)
            grads, losses = ([step_grads] if gradients else []), jnp.reshape(loss.astype(jnp.float32), (1,))
        else:

            def body(carry: tuple[Any, ...], batch: Batch) -> tuple[tuple[Any, ...], jax.Array]:
                state, grads, loss = train_step(carry[0], batch, rng)
                return ((state, grads) if gradients else (state,)), loss.astype(jnp.float32)

            start: tuple[Any, ...] = (state, jax.tree.map(jnp.zeros_like, state.params)) if gradients else (state,)
            (state, *grads), losses = lax.scan(body, start, batches, length=n_steps)
        fingerprint = [fingerprints.of_state(jax.tree.leaves(state))] if fingerprinted else []
        return state, losses, *grads, *fingerprint

    def program(leaves: list[jax.Array], batches: Batch, rng_data: jax.Array) -> tuple[Any, ...]:
        state, rng = _rebuild(treedef, leaves, rng_impl, rng_data)
        state, *outputs = steps(state, batches, rng)
        return jax.tree.leaves(state), *outputs

    return program
