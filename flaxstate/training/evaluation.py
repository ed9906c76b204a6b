"""`EvalLoop`: a callable that turns a `Checkpoint` into a `Summary` of metrics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from flaxstate.checkpoint.records import Checkpoint, Summary
from flaxstate.training import batching
from flaxstate.training.step import compile_eval_step, make_eval_step
from flaxstate.training.task import EvalTask


class EvalLoop:
    """Evaluates a record's state on `n_steps` batches across the devices.

    Returns the record as a `Summary` with `{"eval": {name: mean}}` (averaged
    over all batches and devices) and `{"train": {"loss": record.loss}}`.
    The evaluation data is iterated on across calls and started again when it
    runs out.

    Example:
        >>> evaluate = EvalLoop(EvalTask(apply=model.apply, metrics={"acc": acc},  # doctest: +SKIP
        ...                              data=eval_batches), rng=jax.random.key(1), n_steps=10)
        >>> summary = evaluate(checkpoint)  # doctest: +SKIP
    """

    def __init__(
        self,
        task: EvalTask,
        rng: jax.Array,
        n_steps: int = 1,
        devices: Sequence[jax.Device] | None = None,
        group: str = "eval",
    ) -> None:
        """Prepares the compiled evaluation.

        Args:
            task: what to evaluate.
            rng: the evaluation's random key (kept for models that sample; the
                apply runs without rngs).
            n_steps: batches per evaluation.
            devices: the devices (all devices of all processes by default).
            group: the metrics' group name in the summary.

        Raises:
            ValueError: `n_steps` below 1, or no metrics.
        """
        if n_steps < 1:
            raise ValueError(f"EvalLoop n_steps must be at least 1, got {n_steps}.")
        if not task.metrics:
            raise ValueError("EvalTask.metrics is empty; give at least one {name: metric} to evaluate.")
        self._task = task
        self._rng = rng
        self._n_steps = n_steps
        self._group = group
        self._mesh = batching.mesh_of(devices)
        self._n_local_devices = batching.local_device_count(self._mesh)
        self._iterator = iter(task.data)
        self._evaluate = compile_eval_step(make_eval_step(task.apply, task.metrics, self._mesh.size), self._mesh)

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

        Args:
            checkpoint: a record of `TrainLoop` (or a summary, whose metrics are kept).

        Returns:
            the record with the evaluation's metrics.
        """
        state = jax.device_put(checkpoint.state, batching.replicated(self._mesh))
        totals = None
        for _ in range(self._n_steps):
            batch = batching.normalize(self._next_batch(), "EvalTask")
            batching.check_divisible(batch, self._n_local_devices, "EvalTask")
            values = self._evaluate(state, batching.to_devices(batch, self._mesh, stacked=False))
            totals = values if totals is None else jax.tree.map(jnp.add, totals, values)
        metrics = {name: float(value) / self._n_steps for name, value in jax.device_get(totals).items()}
        return Summary.of(checkpoint, {self._group: metrics, "train": {"loss": checkpoint.loss}})
