"""What to train and what to evaluate: `TrainTask` and `EvalTask`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import optax
from flax.training.dynamic_scale import DynamicScale


@dataclasses.dataclass(frozen=True)
class TrainTask:
    """How to train a model: its apply, an optimizer, a loss and the data.

    Attributes:
        apply: the model's apply, called as `apply(variables, *inputs, rngs=..., mutable=...)`
            (a linen module's `apply`).
        optimizer: the optax optimizer.
        loss: called as `loss(*outputs, *targets)`; returns a scalar.
        data: an iterable of this process's batches, each `(x, y)`,
            `((x, ...), (y, ...))` or `((x, ...), ())`. An iterator with
            `get_state()`/`set_state()` (grain's) resumes exactly; any other
            iterable is re-created and advanced past the consumed batches.
        loss_scale: dynamic loss scaling for float16 compute, e.g. flax's
            `flax.training.dynamic_scale.DynamicScale()`: the loss is scaled
            before the backward pass, a step whose gradients are not finite is
            skipped (parameters, optimizer state and batch statistics
            unchanged) and the scale lowered. The scale is part of the state
            (checkpointed, resumed exactly); records carry `train/loss_scale`
            and `train/skipped_steps` in their metrics. A loss that is itself
            non-finite for `flaxstate.training.scaling.MAX_NONFINITE_LOSSES`
            (10) consecutive steps, and one more, still raises
            `FloatingPointError`. None (the default): no scaling.
        ema_decay: keep an exponential moving average of the parameters in
            the state (`Checkpoint.ema_params`), updated inside the compiled
            step after each optimizer update, `ema = decay * ema + (1 - decay)
            * params`, in float32, from the initial parameters: a float, or
            an optax-style schedule of the step (e.g. a warm-up). It is
            sharded as the parameters are, saved under `state/ema` and
            resumed exactly; a step that loss scaling skips leaves it as it
            was. `EvalLoop(use_ema=True)` evaluates it. None: no EMA.

    Example:
        >>> import optax
        >>> task = TrainTask(apply=lambda v, x: x, optimizer=optax.sgd(0.1),
        ...                  loss=lambda o, y: ((o - y) ** 2).mean(), data=[])
    """

    apply: Callable[..., Any]
    optimizer: optax.GradientTransformation
    loss: Callable[..., Any]
    data: Iterable[Any]
    loss_scale: DynamicScale | None = None
    ema_decay: float | Callable[[Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class EvalTask:
    """How to evaluate a model: its apply, named metrics and the data.

    Attributes:
        apply: the model's apply, called as `apply(variables, *inputs)`
            (no rngs, nothing mutable: the model runs deterministically).
        metrics: `{name: metric(*outputs, *targets) -> scalar}`.
        data: an iterable of this process's batches, as in `TrainTask`.
    """

    apply: Callable[..., Any]
    metrics: Mapping[str, Callable[..., Any]]
    data: Iterable[Any]
