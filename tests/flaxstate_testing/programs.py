"""A dense layer's compiled programs on one device, for the tests of the step, the program and the segment runner."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from flax.core import DenyList

from flaxstate.sharding import Partitioning
from flaxstate.train_state import FlaxOptimTrainState
from flaxstate.training import placement
from flaxstate.training.options import LoopSpec
from flaxstate.training.program import Program
from flaxstate.training.task import TrainTask
from flaxstate_testing.toy import mse

MODEL = nn.Dense(2)
X = np.arange(24, dtype=np.float32).reshape(8, 3) / 10
Y = np.ones((8, 2), np.float32)
MUTABLE = DenyList("intermediates")
"""The loop's default mutable collections."""
RNG = jax.random.key(1)
"""The run's key of `build`'s programs."""


def state(learning_rate: float = 0.1) -> FlaxOptimTrainState:
    """A fresh SGD state of `MODEL`."""
    return FlaxOptimTrainState.create(optax.sgd(learning_rate), MODEL.init(jax.random.key(0), X))


def build(data: Any = (), n_microbatches: int = 1) -> tuple[placement.DataParallel | placement.Sharded, Program, Any]:
    """The one-device placement, the compiled programs of `MODEL` with an MSE loss, and the placed state."""
    where = placement.create(Partitioning(devices=jax.devices()[:1]))
    task = TrainTask(apply=MODEL.apply, optimizer=optax.sgd(0.1), loss=mse, data=data)
    placed = jax.device_put(state(), where.state_shardings(state()))
    spec = LoopSpec(collections={"apply": ()}, mutable_collections=MUTABLE, n_microbatches=n_microbatches)
    program = Program.build(placement=where, task=task, spec=spec, n_microbatches=n_microbatches, state=placed, rng=RNG)
    return where, program, placed
