"""Watching a segment's losses for nan and inf on the devices, off the update's path.

The compiled update only returns each step's loss. `LossWatch` reduces them,
64 dispatches at a time, to the index of the first non-finite one with one
small compiled call, on the devices and without waiting for them; the host
reads those few indices once, when it needs the loss for a record anyway.
Checking inside the update instead cost every step an extra donated input
and output, and reading every loss back cost more than a small step
(`benchmarks/loop_overhead.py`, tiny MLP; benchmarks/RESULTS.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

CHUNK = 64
"""How many dispatches' losses one check reduces (fewer are padded by repeating the last)."""


@jax.jit
def _first_bad_index(losses: tuple[jax.Array, ...]) -> jax.Array:
    """The index of the first non-finite value in the losses laid end to end, or -1."""
    bad = ~jnp.isfinite(jnp.concatenate([jnp.ravel(loss).astype(jnp.float32) for loss in losses]))
    return jnp.where(jnp.any(bad), jnp.argmax(bad).astype(jnp.int32), -1)


class LossWatch:
    """The losses of consecutive dispatches, checked for nan and inf on the devices.

    Its compiled check takes nothing but the losses (no host values: under
    several processes, a host value would need a cross-process check).

    Args:
        step: the step before the first loss that will be added.
    """

    def __init__(self, step: int) -> None:
        self._next_step = step
        self._pending: list[jax.Array] = []
        self._pending_steps = 0
        """The steps of one dispatch in `_pending` (all its dispatches have as many)."""
        self._checks: list[tuple[int, jax.Array]] = []
        self._last: jax.Array | None = None

    def add(self, losses: jax.Array, n_steps: int) -> None:
        """Adds one dispatch's losses: a scalar for one step, shape `(K,)` for K steps."""
        if n_steps != self._pending_steps:
            if self._pending:
                self._check()  # one shape a check, so at most one compiled check per dispatch size
            self._pending_steps = n_steps
        self._pending.append(losses)
        if len(self._pending) == CHUNK:
            self._check()

    def _check(self) -> None:
        padded = self._pending + [self._pending[-1]] * (CHUNK - len(self._pending))
        self._checks.append((self._next_step, _first_bad_index(tuple(padded))))
        self._next_step += len(self._pending) * self._pending_steps
        self._last = self._pending[-1]
        self._pending = []

    def result(self) -> tuple[int | None, float | None]:
        """Waits for the devices; returns the first non-finite step (or `None`) and the last loss (`None` if none)."""
        if self._pending:
            self._check()
        if self._last is None:
            return None, None
        indices, last = jax.device_get(([index for _, index in self._checks], self._last))
        for (step, _), index in zip(self._checks, indices, strict=True):
            if index >= 0:
                return step + int(index) + 1, float(np.ravel(last)[-1])
        return None, float(np.ravel(last)[-1])
