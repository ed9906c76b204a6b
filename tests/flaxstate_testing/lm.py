"""The LM example's transformer in tests: a TrainLoop of it on the example's own data."""

from __future__ import annotations

from typing import Any

import jax

import flaxstate as fs
from flaxstate_testing import examples

lm = examples.load("lm")


def data(config: Any, mesh: Any = None) -> fs.GlobalBatches:
    """The example's batches (with the loop's `mesh`, this process's part of each)."""
    return lm.batches(lm.text(), config, mesh)


def train_loop(
    config: Any,
    init: Any = None,
    batches: Any = None,
    mesh: Any = None,
    optimizer: Any = None,
    ema_decay: Any = None,
    **kwargs: Any,
) -> fs.TrainLoop:
    """A TrainLoop of `lm.Transformer(config)`: fresh, or from `init` (a reader); sharded by `lm.RULES` with `mesh`.

    Records every `config.steps_per_checkpoint` steps, `config.steps_per_dispatch` a dispatch; `kwargs` go to
    the loop (`n_steps`, `n_microbatches`, `record_memory`, ...).
    """
    model = lm.Transformer(config)
    return fs.TrainLoop(
        init=init if init is not None else model.init,
        task=fs.TrainTask(
            apply=model.apply,
            optimizer=optimizer if optimizer is not None else lm.optimizer(config),
            loss=lm.loss,
            data=batches if batches is not None else data(config),
            ema_decay=ema_decay,
        ),
        rng=jax.random.key(config.seed),
        n_steps_per_checkpoint=config.steps_per_checkpoint,
        n_steps_per_dispatch=config.steps_per_dispatch,
        stdout=False,
        mesh=mesh,
        axis_rules=lm.RULES if mesh is not None else None,
        **kwargs,
    )
