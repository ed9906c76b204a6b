"""What to train and what to evaluate: `TrainTask` and `EvalTask`."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx as flax_nnx
from flax.training.dynamic_scale import DynamicScale

from flaxstate import nnx

EMA_CHECK_CHUNK = 1 << 20
"""Steps of an EMA schedule computed at once when a run's steps are checked."""


@dataclasses.dataclass(frozen=True)
class TrainTask:
    """How to train a model: the model, an optimizer, a loss and the data.

    Attributes:
        apply: the model: a linen module's apply, called as `apply(variables,
            *inputs, rngs=..., mutable=...)`, or an `nnx.Module` itself
            (`flaxstate.nnx`), called as the user configured it. The task
            keeps a module's graph and its Variables' shapes, not its arrays
            (`apply` is then the `NNXModel` made of it).
        optimizer: the optax optimizer.
        loss: called as `loss(*outputs, *targets)`; returns a scalar. With an
            NNX module also NNX's `loss_fn(model, batch)` or `loss_fn(model,
            batch, rngs)`, returning a scalar or `(scalar, aux)`: the form of a
            loss whose first parameter is named `model` or `module`, or is
            annotated with an `nnx.Module` class, which gets each batch as the
            data yields it (a dict included).
        data: an iterable of this process's batches, each `(x, y)`,
            `((x, ...), (y, ...))` or `((x, ...), ())` (any structure, a dict
            say, for NNX's `loss_fn(model, batch)`). An iterator with
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
        wrt: with an NNX module, the Variables the optimizer trains, an nnx
            filter as `nnx.Optimizer(model, tx, wrt=...)` takes (`None`:
            `nnx.Param`; `nnx.LoRAParam` trains the adapters alone). Every
            other Variable is carried in the state (see `flaxstate.nnx`).

    Raises:
        ValueError: a constant `ema_decay` outside [0, 1) or not a number;
            `wrt` with a linen apply; `wrt` that selects no Variable.
        TypeError: an NNX object that is not a module (an `nnx.Optimizer`) as
            `apply`, an optimizer that is not optax's (`nnx.Optimizer`
            included), or NNX's loss form without an NNX module.

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
    wrt: Any = None

    def __post_init__(self) -> None:
        if self.ema_decay is not None and not callable(self.ema_decay):
            _check_decay(self.ema_decay, "")
        _check_optimizer(self.optimizer)
        nnx.refuse_nnx_object(self.apply, "TrainTask(apply=...)")
        if nnx.is_module(self.apply):
            wrt = flax_nnx.Param if self.wrt is None else self.wrt
            object.__setattr__(self, "apply", nnx.NNXModel(self.apply, wrt, "TrainTask(apply=...)"))
        elif self.wrt is not None and not isinstance(self.apply, nnx.NNXModel):
            raise ValueError(
                "TrainTask wrt= chooses which Variables of an nnx.Module train; apply is not one. Give "
                "apply=model (the module itself), or leave wrt out."
            )
        if nnx.takes_module(self.loss) and self.nnx_model is None:
            raise TypeError(
                f"TrainTask loss {getattr(self.loss, '__qualname__', self.loss)!r} takes the model first (NNX's "
                "loss_fn(model, batch)); apply is not an nnx.Module. Give apply=model, the module itself, or a "
                "loss of (*outputs, *targets)."
            )

    @property
    def nnx_model(self) -> nnx.NNXModel | None:
        """The NNX module's graph and Variables (`flaxstate.nnx.NNXModel`), or `None` for a linen apply."""
        return self.apply if isinstance(self.apply, nnx.NNXModel) else None

    @property
    def whole_batches(self) -> bool:
        """Whether the loss takes each batch whole (NNX's `loss_fn(model, batch)`), not split into inputs and
        targets."""
        return self.nnx_model is not None and nnx.takes_module(self.loss)

    def step_functions(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The `(apply, loss)` that the compiled step calls: `apply(variables, *inputs, rngs=, mutable=)` and
        `loss(*outputs, *targets)` (NNX's loss form: an apply that gives the loss, and the loss its output)."""
        model = self.nnx_model
        if model is None:
            return self.apply, self.loss
        if self.whole_batches:
            return model.loss_apply(self.loss), _identity
        return model.apply, self.loss

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
    """How to evaluate a model: the model, named metrics and the data.

    Attributes:
        apply: the model's apply, called as `apply(variables, *inputs)`
            (no rngs, nothing mutable: the model runs deterministically),
            or an `nnx.Module` itself, evaluated as a view in evaluation mode
            (dropout off, running statistics) made inside the step: the
            user's module is not changed.
        metrics: `{name: metric(*outputs, *targets) -> scalar}`; with an NNX
            module also NNX's `metric(model, batch)` (a scalar, or `(scalar,
            aux)`), told apart as `TrainTask`'s loss is, each batch whole.
        data: an iterable of this process's batches, as in `TrainTask`.

    Raises:
        TypeError: an NNX object that is not a module as `apply`; metrics of
            both forms; NNX's metric form without an NNX module.
    """

    apply: Callable[..., Any]
    metrics: Mapping[str, Callable[..., Any]]
    data: Iterable[Any]

    def __post_init__(self) -> None:
        nnx.refuse_nnx_object(self.apply, "EvalTask(apply=...)")
        if nnx.is_module(self.apply):
            object.__setattr__(self, "apply", nnx.NNXModel(self.apply, flax_nnx.Param, "EvalTask(apply=...)"))
        forms = {name: nnx.takes_module(metric) for name, metric in self.metrics.items()}
        if len(set(forms.values())) > 1:
            raise TypeError(
                f"EvalTask metrics mix NNX's metric(model, batch) ({sorted(n for n, f in forms.items() if f)}) "
                f"with metric(*outputs, *targets) ({sorted(n for n, f in forms.items() if not f)}): a batch is "
                "given whole to the first and split to the second. Write them in one form."
            )
        if any(forms.values()) and not isinstance(self.apply, nnx.NNXModel):
            raise TypeError("EvalTask metrics of NNX's form metric(model, batch) need apply=model, an nnx.Module.")

    @property
    def whole_batches(self) -> bool:
        """Whether the metrics take each batch whole (NNX's `metric(model, batch)`)."""
        return any(nnx.takes_module(metric) for metric in self.metrics.values())

    def eval_functions(self) -> tuple[Callable[..., Any], Mapping[str, Callable[..., Any]]]:
        """The `(apply, metrics)` the compiled evaluation calls: `apply(variables, *inputs[, rngs=])` and
        `metric(*outputs, *targets)` (an NNX module: its evaluation view; NNX's metric form: one apply for each
        metric, giving its value, and the metric its output)."""
        if not isinstance(self.apply, nnx.NNXModel):
            return self.apply, self.metrics
        if not self.whole_batches:
            return self.apply.eval_apply(), self.metrics
        model = self.apply
        applies = {name: model.eval_apply(metric) for name, metric in self.metrics.items()}

        def apply(variables: Any, *inputs: Any, rngs: Any = None) -> tuple[Any, ...]:
            return tuple(applies[name](variables, *inputs) for name in self.metrics)

        picks = {name: functools.partial(_pick, index) for index, name in enumerate(self.metrics)}
        return apply, picks


def _identity(value: Any) -> Any:
    return value


def _pick(index: int, *outputs: Any) -> Any:
    return outputs[index]


def _check_optimizer(optimizer: Any) -> None:
    if isinstance(optimizer, flax_nnx.Optimizer):
        raise TypeError(
            f"TrainTask optimizer is an nnx.Optimizer ({type(optimizer).__name__}); give its optax transformation "
            "(optimizer=optax.adamw(...)) and the Variables it trains as wrt= (wrt=nnx.Param): the loop makes and "
            "carries the optimizer's state itself."
        )
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"TrainTask optimizer must be an optax GradientTransformation (optax.adam(1e-3)), got "
            f"{type(optimizer).__name__}."
        )
