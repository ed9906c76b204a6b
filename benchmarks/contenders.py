"""What the side-by-side benchmarks share: the small MLP, its data, a loop of it, and rounds in turn.

`goodput.py`, `watchdog.py` and `ema.py` each compare the loop with one
feature against the loop without it, and against itself without it again
(the noise of two equal contenders), in one process.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax

import flaxstate as fs


class MLP(nn.Module):
    """Two hidden layers of `width`, ten classes."""

    width: int = 64

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(2):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(10)(x)


def loss_fn(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_loop(
    steps: int, width: int = 64, batch: int = 64, per_dispatch: int = 1, task: dict[str, Any] | None = None, **loop: Any
) -> fs.TrainLoop:
    """A quiet loop of the MLP on 64 cycled random batches (64 features), a record every `steps` steps, adam."""
    rng = np.random.RandomState(0)
    data = [(rng.randn(batch, 64).astype(np.float32), rng.randint(0, 10, batch).astype(np.int32)) for _ in range(64)]
    model = MLP(width)
    train = fs.TrainTask(
        apply=model.apply, optimizer=optax.adam(1e-3), loss=loss_fn, data=itertools.cycle(data), **(task or {})
    )
    return fs.TrainLoop(
        model.init,
        train,
        0,
        n_steps=10**9,
        n_steps_per_checkpoint=steps,
        n_steps_per_dispatch=per_dispatch,
        stdout=False,
        **loop,
    )


def in_turn(runners: dict[str, Callable[[], Any]], rounds: int, steps: int) -> dict[str, float]:
    """Median microseconds a step of each runner (a round is `steps` steps), each first and last in turn."""
    for run in runners.values():
        run()  # compiles
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            start = time.perf_counter()
            runners[name]()
            times[name].append((time.perf_counter() - start) / steps * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}
