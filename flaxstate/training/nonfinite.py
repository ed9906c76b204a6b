"""Watching a segment's losses for nan and inf on the devices, off the update's path.

The compiled update only returns each step's loss. `LossWatch` reduces them,
256 dispatches at a time, to the index of the first non-finite one with one
small compiled call, on the devices and without waiting for them; the host
reads those few indices once, when it needs the loss for a record anyway.
Checking inside the update instead cost every step an extra donated input
and output, and reading every loss back cost more than a small step
(`benchmarks/loop_overhead.py`, tiny MLP; benchmarks/RESULTS.md).

With a spike factor (`fs.Rollback(spike=f)`) the same check also finds the
first finite loss that rises above the median of the `window` losses before
it by more than `f - 1` times the median's size (above `f` times the median,
for a positive loss), carrying the last `window` losses from check to check (and from record to
record) on the devices.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flaxstate.training import scaling

Reason = Literal["nonfinite", "spike"]


@dataclasses.dataclass(frozen=True)
class BadStep:
    """The first bad step a watch found: its loss non-finite (beyond loss scaling's patience), or a spike."""

    step: int
    reason: Reason


def patience(loss_scaling: bool) -> int:
    """How many non-finite losses in a row pass: loss scaling skips some steps; without it, none."""
    return scaling.MAX_NONFINITE_LOSSES if loss_scaling else 0


def error(step: int, patience: int) -> FloatingPointError:
    """The error that ends training at `step`, where a watch of `patience` reported it."""
    if patience:
        return FloatingPointError(
            f"the training loss was non-finite (nan or inf) for {patience + 1} steps in a "
            f"row, up to step {step}: loss scaling skips such steps, but no scale mends a "
            "forward pass that overflows. No record was yielded after it. Compute the loss in float32, "
            "lower the learning rate, or check the data."
        )
    return FloatingPointError(
        f"the training loss became non-finite (nan or inf) at step {step}; no record "
        "was yielded after it. Lower the learning rate, clip gradients, or check the data."
    )


CHUNK = 256
"""How many dispatches' losses one check reduces at most (fewer are padded by repeating the last, up to
a power of two: a check's call costs about a microsecond an argument, and it compiles once per size).
Each check is one more dispatch, 0.4-0.8 ms of the host's time on an H200 (benchmarks/RESULTS.md, issue
58): 64 a check made 7 of them in a record of 400 one-step dispatches, 256 makes 2."""


@jax.jit
def _first_bad_index(losses: tuple[jax.Array, ...]) -> jax.Array:
    """The index of the first non-finite value in the losses laid end to end, or -1."""
    bad = ~jnp.isfinite(jnp.concatenate([jnp.ravel(loss).astype(jnp.float32) for loss in losses]))
    return jnp.where(jnp.any(bad), jnp.argmax(bad).astype(jnp.int32), -1)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _first_long_run(
    losses: tuple[jax.Array, ...], run: jax.Array | None, patience: int, n_valid: int
) -> tuple[jax.Array, jax.Array]:
    """The index at which a run of non-finite values grows longer than `patience` (or -1), and the run at the end.

    `run` is the run of non-finite values just before these (None: none);
    only the first `n_valid` values are losses (the rest pad a chunk).
    """
    bad = ~jnp.isfinite(jnp.concatenate([jnp.ravel(loss).astype(jnp.float32) for loss in losses]))[:n_valid]

    def count(length: jax.Array, is_bad: jax.Array) -> tuple[jax.Array, jax.Array]:
        length = jnp.where(is_bad, length + 1, 0)
        return length, length

    end, lengths = lax.scan(count, jnp.zeros((), jnp.int32) if run is None else run, bad)
    over = lengths > patience
    return jnp.where(jnp.any(over), jnp.argmax(over).astype(jnp.int32), -1), end


def _order_statistics(rows: jax.Array, ranks: tuple[int, ...]) -> list[jax.Array]:
    """Each row's values of the given ranks (0: the smallest), by counting what lies below each value (ties by
    position): a window's median for a fraction of a sort's cost on a CPU (37 against 72 us for 100 windows of 16)."""
    width = rows.shape[1]
    below = rows[:, None, :] < rows[:, :, None]  # [row, i, j]: value j below value i
    earlier = jnp.arange(width)[None, :] < jnp.arange(width)[:, None]
    rank = jnp.sum(below | ((rows[:, None, :] == rows[:, :, None]) & earlier[None]), axis=2)
    return [jnp.sum(jnp.where(rank == k, rows, 0.0), axis=1) for k in ranks]


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _first_spike(
    losses: tuple[jax.Array, ...], history: jax.Array, n_valid: int, window: int, factor: float
) -> tuple[jax.Array, jax.Array]:
    """The index of the first loss that rises above the median of the `window` losses before it by more than
    `factor - 1` times the median's size (for a positive median: above `factor` times it), or -1; and the last
    `window` losses (the history the next check continues).

    `history` holds the `window` losses before these, nan where there were none (before the window fills: no loss
    is judged whose window holds a nan, or a non-finite loss that loss scaling passed).
    """
    values = jnp.concatenate([jnp.ravel(loss).astype(jnp.float32) for loss in losses])[:n_valid]
    values = jnp.where(jnp.isfinite(values), values, jnp.nan)
    laid = jnp.concatenate([history, values])
    windows = laid[jnp.arange(n_valid)[:, None] + jnp.arange(window)[None, :]]
    judged = jnp.all(jnp.isfinite(windows), axis=1)
    lower, upper = _order_statistics(jnp.where(judged[:, None], windows, 0.0), ((window - 1) // 2, window // 2))
    median = (lower + upper) / 2
    # The rise above the median, against (f - 1) times its size: above f times the median for a positive loss, and
    # never on a flat loss whatever its sign (log-likelihoods, ELBOs and GAN losses are often <= 0).
    rise = jnp.where(median > 0, values > factor * median, values - median > (factor - 1) * jnp.abs(median))
    spikes = judged & rise
    return jnp.where(jnp.any(spikes), jnp.argmax(spikes).astype(jnp.int32), -1), laid[n_valid:]


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _first_bad_and_spike(
    losses: tuple[jax.Array, ...], run: jax.Array | None, history: jax.Array, patience: int, n_valid: int, factor: float
) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array]:
    """`_first_long_run` (or `_first_bad_index` without patience) and `_first_spike` as one call: one dispatch a
    check (two cost a record of 100 steps of a tiny MLP at K=10 a tenth more, `benchmarks/rollback.py`)."""
    if patience:
        index, run = _first_long_run(losses, run, patience, n_valid)
    else:
        index = _first_bad_index(losses)
    spike, history = _first_spike(losses, history, n_valid, history.shape[0], factor)
    return index, run, spike, history


def empty_history(window: int) -> jax.Array:
    """A spike watch's history before any loss: `window` nans."""
    return jnp.full((window,), jnp.nan, jnp.float32)


class LossWatch:
    """The losses of consecutive dispatches, checked for nan and inf on the devices.

    Its compiled check takes nothing but the losses (no host values: under
    several processes, a host value would need a cross-process check).

    Args:
        step: the step before the first loss that will be added.
        patience: how many consecutive non-finite losses pass (with loss
            scaling, whose skipped steps leave the state as it was); one more
            is reported. 0: the first is.
        run: the run of non-finite losses that the previous watch ended with
            (its `run`), which this one continues.
        spike: `(factor, history)`: also report the first loss above
            `factor` times the median of the losses before it, the `window`
            of them in `history` continued (`empty_history(window)` at the
            start); `None`: non-finite losses only.
    """

    def __init__(
        self,
        step: int,
        patience: int = 0,
        run: jax.Array | None = None,
        spike: tuple[float, jax.Array] | None = None,
    ) -> None:
        self._patience = patience
        self.run = run
        """The length of the run of non-finite losses at the end of those checked (a device array, or None)."""
        self._factor = None if spike is None else spike[0]
        self.history = None if spike is None else spike[1]
        """The last `window` losses of those checked (a device array; `None` without a spike factor)."""
        self._spikes: list[tuple[int, jax.Array]] = []
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
        n_pending = len(self._pending)
        padded = tuple(self._pending + [self._pending[-1]] * ((1 << (n_pending - 1).bit_length()) - n_pending))
        n_valid = len(self._pending) * self._pending_steps
        if self._factor is not None and self.history is not None:
            index, self.run, spike, self.history = _first_bad_and_spike(
                padded, self.run, self.history, self._patience, n_valid, self._factor
            )
            self._spikes.append((self._next_step, spike))
        elif self._patience:
            index, self.run = _first_long_run(padded, self.run, self._patience, n_valid)
        else:
            index = _first_bad_index(padded)
        self._checks.append((self._next_step, index))
        self._next_step += len(self._pending) * self._pending_steps
        self._last = self._pending[-1]
        self._pending = []

    def result(self) -> tuple[int | None, float | None]:
        """Waits for the devices; returns the first step reported (or `None`) and the last loss (`None` if none).

        A step is reported when its loss is non-finite and more than
        `patience` in a row are, or (with a spike factor) it spikes.
        """
        bad, last = self.first_bad()
        return None if bad is None else bad.step, last

    def first_bad(self) -> tuple[BadStep | None, float | None]:
        """Waits for the devices; returns the first bad step (`None`: none) and the last loss (`None` if none)."""
        if self._pending:
            self._check()
        if self._last is None:
            return None, None
        checks, spikes = [index for _, index in self._checks], [index for _, index in self._spikes]
        indices, spike_indices, last = jax.device_get((checks, spikes, self._last))
        last_loss = float(np.ravel(last)[-1])
        found = [
            BadStep(step + int(index) + 1, "nonfinite")
            for (step, _), index in zip(self._checks, indices, strict=True)
            if index >= 0
        ]
        found += [
            BadStep(step + int(index) + 1, "spike")
            for (step, _), index in zip(self._spikes, spike_indices, strict=True)
            if index >= 0
        ]
        return min(found, key=lambda bad: bad.step, default=None), last_loss
