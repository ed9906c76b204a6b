"""The one way the tests build a TrainLoop of a toy model; each test module sets its own defaults over it."""

from __future__ import annotations

from typing import Any

import jax
import optax

import flaxstate as fs
from flaxstate_testing import toy


def make_loop(
    data: Any = None,
    *,
    model: Any = None,
    init: Any = None,
    optimizer: Any = None,
    loss: Any = toy.mse,
    loss_scale: Any = None,
    ema_decay: Any = None,
    seed: int = 0,
    n_steps: int = 12,
    every: int = 4,
    per_dispatch: int = 1,
    **options: Any,
) -> fs.TrainLoop:
    """A quiet TrainLoop of `model` (a toy MLP by default) on `data` (40 regression batches of 8 by default).

    Args:
        data: the batches.
        model: the linen module (its `apply`; its `init` unless `init` is given).
        init: the model's `init` or a checkpoint reader.
        optimizer: adam(1e-2) by default.
        loss: the loss.
        loss_scale: float16 loss scaling (`TrainTask(loss_scale=...)`).
        ema_decay: an EMA of the parameters (`TrainTask(ema_decay=...)`).
        seed: the run's key (`jax.random.key(seed)`).
        n_steps: the total steps.
        every: steps a record.
        per_dispatch: steps a dispatch.
        options: any other `TrainLoop` option.
    """
    model = toy.MLP() if model is None else model
    task = fs.TrainTask(
        apply=model.apply,
        optimizer=optax.adam(1e-2) if optimizer is None else optimizer,
        loss=loss,
        data=toy.batches(40, 8) if data is None else data,
        loss_scale=loss_scale,
        ema_decay=ema_decay,
    )
    return fs.TrainLoop(
        model.init if init is None else init,
        task,
        jax.random.key(seed),
        n_steps=n_steps,
        n_steps_per_checkpoint=every,
        n_steps_per_dispatch=per_dispatch,
        **{"stdout": False, **options},
    )
