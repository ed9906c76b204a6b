"""`EvalLoop`: a callable that turns a `Checkpoint` into a `Summary` of metrics."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from flaxstate import settings, sharding
from flaxstate.records import Checkpoint, Summary
from flaxstate.sharding import AxisRules, Partitioning
from flaxstate.train_state import InferenceState
from flaxstate.training import batching, placement
from flaxstate.training.startup import as_key
from flaxstate.training.step import make_eval_step
from flaxstate.training.task import EvalTask


class EvalLoop:
    """Evaluates a record's state on `n_steps` batches across the devices, data-parallel or sharded over a mesh.

    Returns the record as a `Summary` with `{"eval": {name: mean}}` and
    `{"train": {"loss": record.loss}}`. A metric is a function of a batch's
    outputs and targets that returns a scalar, a mean over the batch (e.g.
    accuracy); each batch's value is weighted by its number of examples, so a
    ragged last batch counts as its size, and the mean over all batches is
    the mean over all examples. Every value, integer or float, is averaged as
    a number (in float32): data-parallel, each device's value of its part of
    the batch; a count (an integer sum) is then the mean count of a device's
    part, the same as a float count would give.
    With `mesh` and `axis_rules` (a sharded `TrainLoop`'s), the parameters
    stay sharded by their logical axes, as in training, and the metrics are
    those of the global batch: a model that does not fit on one device is
    evaluated where it lives.
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
        rng: jax.Array | int,
        *,
        n_steps: int = 1,
        devices: Sequence[jax.Device] | None = None,
        group: str = "eval",
        rng_collections: Sequence[str] = (),
        mesh: Mesh | None = None,
        axis_rules: AxisRules | None = None,
        use_ema: bool = False,
        partitioning: Partitioning | None = None,
    ) -> None:
        """Prepares the compiled evaluation.

        Args:
            task: what to evaluate.
            rng: the evaluation's random key (or an int seed), for `rng_collections`.
            n_steps: batches per evaluation.
            devices: the devices (all devices of all processes by default).
            group: the metrics' group name in the summary.
            rng_collections: rng collections to give the model at evaluation
                (none by default, so dropout is off).
            mesh: a `jax.sharding.Mesh` with named axes, with `axis_rules`:
                the parameters and mutable collections are placed by their
                logical axes through the rules, the batch over the mesh axes
                of `batch`, and the evaluation compiled with those shardings
                (each process feeds its part of the batch, as in
                `TrainLoop`). Without them every device holds the whole
                parameters and evaluates its part of the batch.
            axis_rules: flax-style logical axis rules (`TrainLoop`'s).
            use_ema: evaluate the record's EMA of the parameters
                (`Checkpoint.ema_params`, `TrainTask(ema_decay=...)`) instead
                of the parameters.
            partitioning: `fs.Partitioning`, the `TrainLoop`'s (instead of
                `devices=`, `mesh=` and `axis_rules=`).

        Raises:
            ValueError: `n_steps` below 1, or no metrics; only one of `mesh`
                and `axis_rules`, or `mesh` with `devices`; rules naming a
                mesh axis the mesh does not have.
            TypeError: `rng` is neither a key nor an int.
        """
        n_steps = settings.count("EvalLoop", "n_steps", n_steps)
        group = settings.text("EvalLoop", "group", group)
        use_ema = settings.flag("EvalLoop", "use_ema", use_ema)
        if isinstance(rng_collections, str) or not all(isinstance(name, str) for name in rng_collections):
            raise ValueError(
                f"EvalLoop rng_collections must be a list of rng collection names, e.g. ['dropout']; "
                f"got {rng_collections!r}."
            )
        if not task.metrics:
            raise ValueError("EvalTask.metrics is empty; give at least one {name: metric} to evaluate.")
        self._task = task
        self._rng = as_key(rng, "EvalLoop")
        self._rng_collections = tuple(rng_collections)
        self._n_steps = n_steps
        self._group = group
        self._use_ema = use_ema
        self._placement = placement.create(sharding.resolve("EvalLoop", partitioning, devices, mesh, axis_rules))
        self._iterator = iter(task.data)
        self._eval_step = evaluation_step(task, self._placement, self._rng_collections, jax.random.key_impl(self._rng))
        self._compiled: dict[Any, tuple[Any, Callable[..., Any]]] = {}
        """The state's shardings and compiled evaluation by its structure and shapes (one, unless several models
        come)."""

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

        A preemption notice stops it early, so that the writers after it save
        in time (`Checkpoint.evaluation_cut_short` says so): a preempted
        record is not evaluated, and a notice that comes while it evaluates
        (one process's loop) stops it before its next batch.

        Args:
            checkpoint: a record of `TrainLoop` (or a summary, whose metrics are kept).

        Returns:
            the record with the evaluation's metrics.
        """
        with self._placement.context():
            return self._evaluate(checkpoint)

    def _evaluate(self, checkpoint: Checkpoint) -> Summary:
        noticed = checkpoint.preemption_noticed
        if checkpoint.preempted:
            return self._cut_short(checkpoint, None, 0)
        record_state = checkpoint.device_state() if checkpoint.device_state is not None else None
        if record_state is None:
            record_state = checkpoint.state
        params = record_state.params
        if self._use_ema:
            params = getattr(record_state, "ema", None)
            if params is None:
                raise ValueError(
                    f"EvalLoop(use_ema=True) was given the record of step {checkpoint.step}, which holds no EMA of "
                    "the parameters: train with TrainTask(ema_decay=...), or evaluate with use_ema=False."
                )
        needed = evaluated_part(record_state, params)
        shardings, evaluate = self._compiled_for(needed)
        state = jax.device_put(needed, shardings)  # the loop's own device arrays stay where they are
        totals, n_examples = None, 0
        for index in range(self._n_steps):
            if noticed is not None and noticed():
                return self._cut_short(checkpoint, totals, n_examples, index)
            batch = batching.normalize(self._next_batch(), "EvalTask", whole=self._task.whole_batches)
            self._placement.check_batch(batch, "EvalTask")
            size = self._placement.global_batch_size(batching.local_size(batch))
            rng_data = self._batch_rng_data(int(checkpoint.step), index)
            values = evaluate(state, self._placement.to_devices(batch, stacked=False), rng_data)
            weighted = jax.tree.map(lambda value, size=size: value * size, values)
            totals = weighted if totals is None else jax.tree.map(jnp.add, totals, weighted)
            n_examples += size
        metrics = {name: float(value) / n_examples for name, value in jax.device_get(totals).items()}
        return checkpoint.with_metrics({self._group: metrics, "train": {"loss": checkpoint.loss}})

    def _cut_short(self, checkpoint: Checkpoint, totals: Any, n_examples: int, n_done: int = 0) -> Summary:
        """The record with the means of the batches evaluated (if any) and the cut noted."""
        metrics: dict[str, dict[str, float]] = {"train": {"loss": checkpoint.loss}}
        if totals is not None and n_examples:
            metrics[self._group] = {name: float(value) / n_examples for name, value in jax.device_get(totals).items()}
        summary = checkpoint.with_metrics(metrics)
        cut = {**summary.evaluation_cut_short, self._group: (n_done, self._n_steps)}
        return dataclasses.replace(summary, evaluation_cut_short=cut)

    def _compiled_for(self, state: InferenceState) -> tuple[Any, Callable[..., Any]]:
        """The state's shardings and the evaluation compiled with them, made once per structure and shapes.

        The structure holds the logical axes (static fields), so the
        shardings, and the checks of the shapes against the mesh, are made
        for the first record and reused for every record after it.
        """
        key = (jax.tree.structure(state), tuple(np.shape(leaf) for leaf in jax.tree.leaves(state)))
        if key not in self._compiled:
            shardings = self._placement.state_shardings(state)
            self._compiled[key] = (shardings, self._placement.compile_eval(self._eval_step, shardings))
        return self._compiled[key]

    def _batch_rng_data(self, step: int, index: int) -> jax.Array:
        """The raw key of one evaluation batch (unused without rng collections)."""
        key = self._rng if not self._rng_collections else jax.random.fold_in(jax.random.fold_in(self._rng, step), index)
        return jax.random.key_data(key)


def evaluation_step(
    task: EvalTask, where: placement.Placement, rng_collections: Sequence[str] = (), rng_impl: Any = None
) -> Callable[..., Any]:
    """The per-device evaluation of `task` on `where` (`make_eval_step`), as `EvalLoop` and `fs.plan` compile it."""
    apply, metrics = task.eval_functions()
    return make_eval_step(apply, metrics, tuple(rng_collections), where.across, rng_impl)


def evaluated_part(state: Any, params: Any) -> InferenceState:
    """What an evaluation reads of a (training) state: its step, `params` (its parameters or their EMA) and its
    mutable collections, never the optimizer's state."""
    return InferenceState(
        step=state.step,
        params=params,
        flax_mutables=state.flax_mutables,
        params_axes=getattr(state, "params_axes", None),
        flax_mutables_axes=getattr(state, "flax_mutables_axes", None),
    )
