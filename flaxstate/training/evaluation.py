"""`EvalLoop`: a callable that turns a `Checkpoint` into a `Summary` of metrics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from flaxstate.records import Checkpoint, Summary
from flaxstate.train_state import InferenceState
from flaxstate.training import batching, copies
from flaxstate.training.step import compile_eval_step, make_eval_step
from flaxstate.training.task import EvalTask


class EvalLoop:
    """Evaluates a record's state on `n_steps` batches across the devices.

    Returns the record as a `Summary` with `{"eval": {name: mean}}` (averaged
    over all batches and devices) and `{"train": {"loss": record.loss}}`.
    The evaluation data is iterated on across calls and started again when it
    runs out. The model runs with no rngs and nothing mutable, unless
    `rng_collections` names rng collections (e.g. for a model that samples):
    their keys come from `rng`, folded with the record's step and the batch's
    index, so an evaluation is reproducible.

    Example:
        >>> import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
        >>> model = nn.Dense(1)
        >>> state = InferenceState.create(model.init(jax.random.key(0), jnp.ones((1, 3))))
        >>> data = [(np.ones((4, 3), np.float32), np.zeros((4, 1), np.float32))]
        >>> evaluate = EvalLoop(EvalTask(apply=model.apply, metrics={"mse": lambda y, t: jnp.mean((y - t) ** 2)},
        ...                              data=data), rng=jax.random.key(1))
        >>> record = Checkpoint(state=state, grads=None, loss=0.0, n_completed_steps=0, elapsed_time=0.0, step=0)
        >>> sorted(evaluate(record).metrics)
        ['eval', 'train']
    """

    def __init__(
        self,
        task: EvalTask,
        rng: jax.Array,
        n_steps: int = 1,
        devices: Sequence[jax.Device] | None = None,
        group: str = "eval",
        rng_collections: Sequence[str] = (),
    ) -> None:
        """Prepares the compiled evaluation.

        Args:
            task: what to evaluate.
            rng: the evaluation's random key, for `rng_collections`.
            n_steps: batches per evaluation.
            devices: the devices (all devices of all processes by default).
            group: the metrics' group name in the summary.
            rng_collections: rng collections to give the model at evaluation
                (none by default, so dropout is off).

        Raises:
            ValueError: `n_steps` below 1, or no metrics.
        """
        if n_steps < 1:
            raise ValueError(f"EvalLoop n_steps must be at least 1, got {n_steps}.")
        if not task.metrics:
            raise ValueError("EvalTask.metrics is empty; give at least one {name: metric} to evaluate.")
        self._task = task
        self._rng = jax.random.key(rng) if isinstance(rng, int) else rng
        self._rng_collections = tuple(rng_collections)
        self._n_steps = n_steps
        self._group = group
        self._mesh = batching.mesh_of(devices)
        self._n_local_devices = batching.local_device_count(self._mesh)
        self._iterator = iter(task.data)
        self._rng_data = jax.random.key_data(self._rng)
        self._rng_impl = jax.random.key_impl(self._rng)
        eval_step = make_eval_step(task.apply, task.metrics, self._rng_collections, self._mesh.size, self._rng_impl)
        self._evaluate = compile_eval_step(eval_step, self._mesh)

    def _next_batch(self) -> Any:
        try:
            return next(self._iterator)
        except StopIteration:
            if self._iterator is self._task.data:
                raise ValueError(
                    "EvalTask.data ran out; give a re-iterable (e.g. a list) or a repeated dataset."
                ) from None
            self._iterator = iter(self._task.data)
            try:
                return next(self._iterator)
            except StopIteration:
                raise ValueError("EvalTask.data is empty: it yielded no batch.") from None

    def __call__(self, checkpoint: Checkpoint) -> Summary:
        """Evaluates `checkpoint.state` and returns the summary.

        A `TrainLoop` record holds its state in host memory (see its
        `record_memory`). While the record is the loop's newest (until the
        loop trains on), the loop's own device arrays are evaluated; else
        the parameters and mutable collections (never the optimizer state)
        are put on the devices for this call.

        Args:
            checkpoint: a record of `TrainLoop` (or a summary, whose metrics are kept).

        Returns:
            the record with the evaluation's metrics.
        """
        record_state = copies.device_view(checkpoint.state)
        if record_state is None:
            record_state = checkpoint.state
        needed = InferenceState(
            step=record_state.step, params=record_state.params, flax_mutables=record_state.flax_mutables
        )
        state = jax.device_put(needed, batching.replicated(self._mesh))
        totals = None
        for index in range(self._n_steps):
            batch = batching.normalize(self._next_batch(), "EvalTask")
            batching.check_divisible(batch, self._n_local_devices, "EvalTask")
            rng_data = self._batch_rng_data(int(checkpoint.step), index)
            values = self._evaluate(state, batching.to_devices(batch, self._mesh, stacked=False), rng_data)
            totals = values if totals is None else jax.tree.map(jnp.add, totals, values)
        metrics = {name: float(value) / self._n_steps for name, value in jax.device_get(totals).items()}
        return checkpoint.with_metrics({self._group: metrics, "train": {"loss": checkpoint.loss}})

    def _batch_rng_data(self, step: int, index: int) -> jax.Array:
        """The raw key of one evaluation batch (unused without rng collections)."""
        if not self._rng_collections:
            return self._rng_data
        key = jax.random.wrap_key_data(self._rng_data, impl=self._rng_impl)
        return jax.random.key_data(jax.random.fold_in(jax.random.fold_in(key, step), index))
