"""Going back when the loss goes bad: on a non-finite loss or a spike, every process returns to the last good state.

    >>> import flaxstate as fs
    >>> fs.Rollback(max_rollbacks=2, spike=4.0, lr_scale=0.5)
    Rollback(max_rollbacks=2, spike=4.0, window=16, lr_scale=0.5)

`TrainLoop(..., rollback=fs.Rollback())` arms it. The loss watch finds the
first bad step of a record's steps on the devices (`flaxstate.training.nonfinite`):
a non-finite loss, or with `spike=f` a loss above `f` times the median of the
`window` steps' losses before it. At the record, where the host reads the
losses anyway, the processes agree on the first bad step (one small
collective a record, never a step), and every one of them goes back to the
state of the newest record before it (`to_step`), held on the host as the
record holds it (the run's start state before the first record), skips the
batches of the steps after `to_step` through the bad step, scales the
learning rate by `lr_scale` (an optimizer built with `optax.inject_hyperparams`)
and trains on. More than `max_rollbacks` rollbacks end the run with the
`FloatingPointError` the loop raises without a `Rollback`, naming them.

The run's rollbacks are part of its data position, saved with every
checkpoint: a resume skips the same batches, and counts the rollbacks made
before it against `max_rollbacks`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from flaxstate import settings
from flaxstate.training.nonfinite import BadStep, Reason

REASONS: tuple[Reason, ...] = ("nonfinite", "spike")


@dataclasses.dataclass(frozen=True)
class Rollback:
    """Rolls the training back to the last good state on a non-finite loss (or a spike) and trains on.

    Args:
        max_rollbacks: how many rollbacks the run may make (those before a
            resume count); one more raises the `FloatingPointError` of a run
            without a `Rollback`, naming the rollbacks made.
        spike: `f`: a finite loss above `f` times the median of the previous
            `window` steps' losses is bad too (judged from step `window + 1`
            on); `None`: only non-finite losses are. Judged as the rise above
            the median: more than `f - 1` times the median's size, so that a
            loss <= 0 (a log-likelihood, an ELBO) spikes when it rises as far,
            and a flat loss never does, whatever its sign.
        window: the steps whose median a loss is held against (`spike`).
        lr_scale: the learning rate is multiplied by this at each rollback,
            where the optimizer was built with `optax.inject_hyperparams`
            (its rate is `state.param_states.hyperparams["learning_rate"]`);
            `None`: the rate stays.

    Raises:
        ValueError: `max_rollbacks` or `window` not a count, `spike` not a
            number above 1, or `lr_scale` not a number in (0, 1].
    """

    max_rollbacks: int = 3
    spike: float | None = None
    window: int = 16
    lr_scale: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "max_rollbacks", settings.count("Rollback", "max_rollbacks", self.max_rollbacks, minimum=0)
        )
        object.__setattr__(self, "window", settings.count("Rollback", "window", self.window))
        if self.spike is not None:
            if not settings.is_real(self.spike) or not math.isfinite(self.spike) or self.spike <= 1:
                raise ValueError(
                    f"Rollback spike must be a factor above 1 (a loss above spike x the median of the previous "
                    f"window steps' losses is a spike), or None, got {self.spike!r}."
                )
            object.__setattr__(self, "spike", float(self.spike))
        if self.lr_scale is not None:
            if not settings.is_real(self.lr_scale) or not 0 < self.lr_scale <= 1:
                raise ValueError(f"Rollback lr_scale must be a number in (0, 1], or None, got {self.lr_scale!r}.")
            object.__setattr__(self, "lr_scale", float(self.lr_scale))


def check(rollback: Any, owner: str = "TrainLoop") -> Rollback | None:
    """`rollback` as `TrainLoop` takes it: a `Rollback` or `None`.

    Raises:
        ValueError: anything else, naming it.
    """
    if rollback is None or isinstance(rollback, Rollback):
        return rollback
    raise ValueError(f"{owner} rollback must be a fs.Rollback(...) or None, got {rollback!r}.")


def learning_rate_holder(state: Any) -> Mapping[str, Any]:
    """The `hyperparams` of an `optax.inject_hyperparams` optimizer's state that `lr_scale` scales.

    Raises:
        ValueError: an optimizer state without a `learning_rate` hyperparameter, naming the fix.
    """
    hyperparams = getattr(state.param_states, "hyperparams", None)
    if not isinstance(hyperparams, Mapping) or "learning_rate" not in hyperparams:
        found = type(state.param_states).__name__
        raise ValueError(
            f"Rollback(lr_scale=...) scales the learning rate in state.param_states.hyperparams['learning_rate'], "
            f"but the optimizer's state is a {found} without one. Build the optimizer with "
            "optax.inject_hyperparams (e.g. optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)), or leave "
            "lr_scale out."
        )
    return hyperparams


def scaled(state: Any, factor: float) -> Any:
    """`state` with its learning rate (`learning_rate_holder`) multiplied by `factor`, in its own dtype."""
    hyperparams = dict(learning_rate_holder(state))
    rate = hyperparams["learning_rate"]
    hyperparams["learning_rate"] = (np.asarray(rate) * factor).astype(np.asarray(rate).dtype)
    param_states = state.param_states._replace(hyperparams=hyperparams)
    return state.replace(param_states=param_states)


def agree(bad: BadStep | None) -> BadStep | None:
    """The earliest bad step any process found (the same on every process; a collective under several)."""
    if jax.process_count() == 1:
        return bad
    mine = np.asarray([-1, -1] if bad is None else [bad.step, REASONS.index(bad.reason)], np.int64)
    rows = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), 2)
    found = [(int(step), int(reason)) for step, reason in rows if step >= 0]
    if not found:
        return None
    step, reason = min(found)
    return BadStep(step, REASONS[reason])


def made(position: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The rollbacks that a saved data position lists (none before any)."""
    return [dict(entry) for entry in (position or {}).get("rollbacks", [])]


def entry(bad: BadStep, to_step: int, skipped: Sequence[int]) -> dict[str, Any]:
    """One rollback as a record lists it (`Checkpoint.rollbacks`)."""
    return {"at_step": bad.step, "to_step": to_step, "reason": bad.reason, "skipped_steps": list(skipped)}


def describe(entries: Sequence[Mapping[str, Any]]) -> str:
    """The rollbacks made, for a line: `at step 57 to step 50 (nonfinite)`, ..."""
    return "; ".join(f"at step {e['at_step']} to step {e['to_step']} ({e['reason']})" for e in entries) or "none"


def error(bad: BadStep, entries: Sequence[Mapping[str, Any]], rollback: Rollback) -> FloatingPointError:
    """The error past `max_rollbacks`: the bad step and the rollbacks made."""
    what = (
        "became non-finite (nan or inf)"
        if bad.reason == "nonfinite"
        else f"spiked above {rollback.spike:g} times the median of the previous {rollback.window} steps' losses"
    )
    return FloatingPointError(
        f"the training loss {what} at step {bad.step}, after {len(entries)} rollbacks "
        f"(Rollback(max_rollbacks={rollback.max_rollbacks})): {describe(entries)}. No record was yielded after it. "
        "Lower the learning rate, clip gradients, check the data, or allow more rollbacks."
    )
