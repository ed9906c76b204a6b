"""What to train and what to evaluate: `TrainTask` and `EvalTask`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax.training.dynamic_scale import DynamicScale

EMA_CHECK_CHUNK = 1 << 20
"""Steps of an EMA schedule computed at once when a run's steps are checked."""


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
            was. `EvalLoop(use_ema=True)` evaluates it. None: no EMA. A decay
            must lie in [0, 1): a constant is checked here, a schedule at
            every step the loop will train (`check_ema_decays`), before it
            trains them.

    Raises:
        ValueError: a constant `ema_decay` outside [0, 1) or not a number.

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

    def __post_init__(self) -> None:
        if self.ema_decay is not None and not callable(self.ema_decay):
            _check_decay(self.ema_decay, "")

    def check_ema_decays(self, first: int, stop: int) -> None:
        """Checks a schedule's decay at every step in [first, stop), computed a chunk of steps at once.

        Raises:
            ValueError: a decay outside [0, 1) or not finite, naming the first such step.
        """
        if not callable(self.ema_decay) or stop <= first:
            return
        _check_decay(np.asarray(self.ema_decay(first)), f" (the schedule's value at step {first})")  # its type too
        values_of = jax.jit(jax.vmap(self.ema_decay))
        for start in range(first, stop, EMA_CHECK_CHUNK):
            steps = np.arange(start, min(start + EMA_CHECK_CHUNK, stop), dtype=np.int32)
            values = np.broadcast_to(np.asarray(values_of(steps), dtype=np.float64), steps.shape)
            bad = ~(np.isfinite(values) & (values >= 0) & (values < 1))
            if bad.any():
                at = int(np.argmax(bad))
                _check_decay(values[at], f" (the schedule's value at step {steps[at]})")


def _check_decay(decay: Any, where: str) -> float:
    try:
        if isinstance(decay, str | bytes):
            raise TypeError(decay)
        value = float(decay)
    except (TypeError, ValueError):
        raise ValueError(
            f"TrainTask ema_decay must be a number in [0, 1) or a schedule of the step, got {decay!r}{where}."
        ) from None
    if isinstance(decay, bool) or not math.isfinite(value) or not 0 <= value < 1:
        raise ValueError(
            f"TrainTask ema_decay must lie in [0, 1), got {decay!r}{where}: the EMA is decay * ema + (1 - decay) * "
            "params, so a decay of 1 or more never follows the parameters and a negative one diverges. A typical "
            "decay is 0.999."
        )
    return value


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
