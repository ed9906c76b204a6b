"""When a writer saves: one frozen policy object, checked once where it is made.

    >>> import flaxstate as fs
    >>> fs.EverySeconds(600)
    EverySeconds(seconds=600.0)
    >>> fs.AutoInterval(min_seconds=30, mtbf=3600)
    AutoInterval(min_seconds=30.0, mtbf=3600.0, history=None)

`CheckpointFileWriter(dir, every=policy)` takes one:

- `EveryRecord()` (the default): every record it is given.
- `EverySeconds(seconds)`: a record once `seconds` have passed since the last
  save (or since the writer was made).
- `Continuous(min_seconds=0)`: a record whenever no save of the writer's is in
  flight and `min_seconds` have passed since the last one started; a record
  that comes while a save runs is passed over, so the loop never waits for a
  save (orbax's `ContinuousCheckpointingPolicy`, MaxText's
  `enable_continuous_checkpointing`).
- `AutoInterval(min_seconds=0, mtbf=None, history=None)`: as `Continuous`, at
  the interval that loses the least time by Young and Daly's rule, from the
  save's measured cost to the training and the run's failures
  (`flaxstate.checkpoint.schedule`).

`every=None` is `EveryRecord()`. The writer's old keywords, deprecated
(a `DeprecationWarning` once a process, naming the policy), still build
these at its door: `every_seconds=S` is `EverySeconds(S)`,
`every="continuous", min_seconds=M` is `Continuous(M)`, `every="auto",
min_seconds=M, mtbf=F` is `AutoInterval(M, F)`. Final, preempted and
requested records are always saved, whatever the policy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal, TypeAlias

from flaxstate import settings
from flaxstate.run_record.cadence import RunHistory


def _seconds(owner: str, name: str, value: Any, zero: bool) -> float:
    if settings.is_real(value) and math.isfinite(value) and (value > 0 or (zero and value == 0)):
        return float(value)
    takes = "a number of seconds, 0 or more" if zero else "a positive number of seconds"
    raise ValueError(f"{owner} {name} must be {takes}, got {value!r} (a {type(value).__name__}).")


@dataclasses.dataclass(frozen=True)
class EveryRecord:
    """Saves every record the writer is given (the default)."""


@dataclasses.dataclass(frozen=True)
class EverySeconds:
    """Saves a record once `seconds` have passed since the last save (or since the writer was made).

    Args:
        seconds: the least seconds between two saves (positive).

    Raises:
        ValueError: `seconds` not a positive finite number.
    """

    seconds: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "seconds", _seconds("EverySeconds", "seconds", self.seconds, zero=False))


@dataclasses.dataclass(frozen=True)
class Continuous:
    """Saves a record whenever no save of the writer's is in flight, at least `min_seconds` after the last one
    started; records that come while one runs are passed over, so the loop never waits for a save.

    Args:
        min_seconds: the least seconds between the starts of two saves (0 or more).

    Raises:
        ValueError: `min_seconds` negative or not a finite number.
    """

    min_seconds: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_seconds", _seconds("Continuous", "min_seconds", self.min_seconds, zero=True))


HistorySource: TypeAlias = "RunHistory | Callable[[], RunHistory | None] | None"


@dataclasses.dataclass(frozen=True)
class AutoInterval:
    """Saves as `Continuous`, at the interval that loses the least time by Young and Daly's rule,
    `sqrt(2 x cost x mtbf)`, from this writer's measured save cost (its call's blocking plus the drag of the save
    in the background on the steps) and the run's failures; bounded below by `min_seconds` and above by
    `flaxstate.run_record.cadence.MAX_SECONDS`. Each change of interval is logged with its inputs and kept in
    the ledger.

    Args:
        min_seconds: the least seconds between the starts of two saves (0 or more).
        mtbf: a prior of the mean seconds between the job's failures (the run's failures refine it; without one,
            the run's time so far with no failure counts).
        history: the run's failures before this session. `None`: the writer's own ledger's, read at its first
            record (a run directory's writer), or, for a writer that keeps no ledger (a local tier's), that of
            the open run-directory writer of the same run in this process (`CheckpointFileWriter.run_history`).
            A `RunHistory`: these figures. A function: called at each decision, returning a `RunHistory` or
            `None` while unknown (e.g. another writer's `run_history`).

    Raises:
        ValueError: `min_seconds` negative, `mtbf` not positive, or `history` none of these.
    """

    min_seconds: float = 0.0
    mtbf: float | None = None
    history: HistorySource = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_seconds", _seconds("AutoInterval", "min_seconds", self.min_seconds, zero=True))
        object.__setattr__(self, "mtbf", settings.optional_seconds("AutoInterval", "mtbf", self.mtbf))
        if self.history is not None and not isinstance(self.history, RunHistory) and not callable(self.history):
            raise ValueError(
                f"AutoInterval history must be a RunHistory, a function returning one (or None), or None (the "
                f"run's ledger), got {self.history!r}."
            )


SavePolicy: TypeAlias = EveryRecord | EverySeconds | Continuous | AutoInterval
"""When a writer saves (one of this module's policies)."""
EVERY_RECORD = EveryRecord()
"""The default policy."""
POLICIES = (EveryRecord, EverySeconds, Continuous, AutoInterval)
Every: TypeAlias = "SavePolicy | Literal['continuous', 'auto'] | None"
"""What a writer's `every=` takes: a policy, or the old keywords' strings."""


def from_keywords(
    owner: str, every: Any, every_seconds: Any, min_seconds: Any, mtbf: Any
) -> EveryRecord | EverySeconds | Continuous | AutoInterval:
    """The policy that a writer's keywords give (`every=`, `every_seconds=`, `min_seconds=`, `mtbf=`).

    Raises:
        ValueError: an unknown `every`, seconds that are not positive numbers, `every_seconds` with `every`,
            `min_seconds` without it, `mtbf` without `every="auto"`, or a policy with any of the three.
    """
    if isinstance(every, POLICIES):
        given = {"every_seconds": every_seconds, "min_seconds": min_seconds, "mtbf": mtbf}
        extra = [f"{name}={value!r}" for name, value in given.items() if value is not None]
        if extra:
            raise ValueError(
                f"{owner} got every={every!r} and {', '.join(extra)}: the policy says when to save. Give the "
                f"seconds to the policy (e.g. Continuous(min_seconds=...), AutoInterval(mtbf=...)) and leave "
                f"{', '.join(name.split('=')[0] for name in extra)} out."
            )
        return every
    if every is not None and every not in ("continuous", "auto"):
        raise ValueError(
            f"{owner} every must be None (every record), 'continuous' or 'auto', got {every!r}, or a save "
            "policy (fs.EveryRecord(), fs.EverySeconds(s), fs.Continuous(min_seconds), fs.AutoInterval(...)); "
            "every_seconds= saves at a fixed time interval."
        )
    if every is not None and every_seconds is not None:
        raise ValueError(
            f"{owner} got every={every!r} and every_seconds={every_seconds!r}: both set when to save. Give "
            f"one; min_seconds= is the least time between saves with every={every!r}."
        )
    if every is None and min_seconds is not None:
        raise ValueError(
            f"{owner} got min_seconds={min_seconds!r} without every=: it bounds every='continuous' and "
            "every='auto'. Add one, or give every_seconds= for a fixed interval."
        )
    if every != "auto" and mtbf is not None:
        raise ValueError(
            f"{owner} got mtbf={mtbf!r} with every={every!r}: the mean time between failures chooses "
            "every='auto''s interval. Add every='auto', or leave mtbf out."
        )
    every_seconds = settings.optional_seconds(owner, "every_seconds", every_seconds)  # named as given
    zero = min_seconds is None or (settings.is_real(min_seconds) and min_seconds == 0)
    least = 0.0 if zero else settings.optional_seconds(owner, "min_seconds", min_seconds) or 0.0
    mtbf = settings.optional_seconds(owner, "mtbf", mtbf)
    policy: EveryRecord | EverySeconds | Continuous | AutoInterval
    if every == "auto":
        policy = AutoInterval(min_seconds=least, mtbf=mtbf)
    elif every == "continuous":
        policy = Continuous(min_seconds=least)
    else:
        policy = EveryRecord() if every_seconds is None else EverySeconds(every_seconds)
    keywords = {"every": every, "every_seconds": every_seconds, "min_seconds": min_seconds, "mtbf": mtbf}
    old = [
        f"{name}={value!r}" if name == "every" else f"{name}=" for name, value in keywords.items() if value is not None
    ]
    if old:
        settings.deprecated(owner, ", ".join(old), f"every=fs.{policy!r}")
    return policy
