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
from typing import Any, ClassVar, Literal, Protocol, TypeAlias, runtime_checkable

from flaxstate import settings
from flaxstate.run_record import cadence
from flaxstate.run_record.cadence import RunHistory


def _seconds(owner: str, name: str, value: Any, zero: bool) -> float:
    if settings.is_real(value) and math.isfinite(value) and (value > 0 or (zero and value == 0)):
        return float(value)
    takes = "a number of seconds, 0 or more" if zero else "a positive number of seconds"
    raise ValueError(f"{owner} {name} must be {takes}, got {value!r} (a {type(value).__name__}).")


@dataclasses.dataclass(frozen=True)
class SaveContext:
    """What a writer measured when a record comes, which its policy decides from (`SavePolicy.due`).

    Seconds are on the writer's clock (monotonic; a test moves its own).
    """

    now: float
    """The clock now."""
    session_seconds: float
    """Seconds since the writer was made."""
    since_save: float
    """Seconds since the newest save's call returned, or since the writer was made before the first."""
    since_start: float | None
    """Seconds since the newest save started; `None` before the first."""
    in_flight: bool
    """Whether a save of the writer's still runs in the background."""
    save_cost: float | None
    """The seconds of training a recent save cost, averaged (its call's blocking plus the drag of the save in the
    background on the steps: `flaxstate.checkpoint.schedule`); `None` before the first save."""
    history: RunHistory | None
    """The run's failures and seconds of running before this session, as the writer's goodput ledger read them;
    `None` where the writer keeps no ledger (a local tier's) or before its first record."""


@dataclasses.dataclass(frozen=True)
class IntervalChange:
    """A new interval of `AutoInterval`'s, with the inputs it came from (what the log line and the ledger's
    `cadence` event say)."""

    interval: float
    """The seconds between saves now."""
    cost: float
    """The seconds of training a recent save cost, averaged."""
    mtbf: float
    """The mean seconds between failures it assumed."""
    failures: int
    observed: float
    """The seconds of running those failures came in."""
    prior: float | None
    """The policy's `mtbf`, where given."""
    expected_loss: float
    """The seconds a failure is expected to lose at this interval."""

    def event(self) -> dict[str, Any]:
        """The ledger's `cadence` event's fields."""
        return dataclasses.asdict(self)

    def line(self, owner: str) -> str:
        """The log line of the change, with its inputs."""
        prior = "" if self.prior is None else f", prior mtbf={self.prior:.0f} s"
        rule = cadence.young_daly(self.cost, self.mtbf)
        bounded = "" if math.isclose(self.interval, rule) else f" (bounded; the rule gives {rule:.1f} s)"
        return (
            f"{owner}: saving every {self.interval:.1f} s{bounded} = sqrt(2 x {self.cost:.3f} s a save costs "
            f"x {self.mtbf:.0f} s between failures: {self.failures} in {self.observed:.0f} s of running"
            f"{prior}); a failure is expected to lose {self.expected_loss:.1f} s"
        )


@dataclasses.dataclass(frozen=True)
class SaveDecision:
    """A policy's answer with what it chose: whether to save, and an interval that it chose anew (the writer logs
    it and keeps it in its ledger when it moved by more than a tenth)."""

    save: bool
    interval: IntervalChange | None = None


@runtime_checkable
class SavePolicy(Protocol):
    """When a writer saves: anything with `due(context)`, asked at each record that is not final, preempted or
    requested (those are always saved).

    A policy of your own implements `due`; the writer measures what the context holds. Under several processes
    the primary process's decision is every process's (a save is a collective): the writer broadcasts it,
    unless the policy's class sets `broadcast = False` (a decision that reads no clock and no save in flight,
    the same on every process).

    Example:
        >>> import dataclasses
        >>> import flaxstate as fs
        >>> @dataclasses.dataclass(frozen=True)
        ... class NotWhileSaving:
        ...     def due(self, context: fs.SaveContext) -> bool:
        ...         return not context.in_flight
        >>> isinstance(NotWhileSaving(), fs.SavePolicy)
        True
    """

    def due(self, context: SaveContext) -> bool | SaveDecision:
        """Whether to save the record that came (`True`/`False`), or a `SaveDecision` with what was chosen."""
        ...


@dataclasses.dataclass(frozen=True)
class EveryRecord:
    """Saves every record the writer is given (the default)."""

    broadcast: ClassVar[bool] = False
    """Every process decides the same, with no collective."""

    def due(self, context: SaveContext) -> bool:
        return True


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

    def due(self, context: SaveContext) -> bool:
        return context.since_save >= self.seconds


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

    def due(self, context: SaveContext) -> bool:
        return not context.in_flight and (context.since_start is None or context.since_start >= self.min_seconds)


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
            record (a run directory's writer; a writer that keeps no ledger, a local tier's, counts none). A
            `RunHistory`: these figures. A function: called at each decision, returning a `RunHistory` or
            `None` while unknown: the persistent writer's `run_history`, handed to a local tier's policy
            (`fs.AutoInterval(history=persistent.run_history)`).

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

    def run_history(self, context: SaveContext) -> RunHistory:
        """The run's failures before this session: the policy's `history`, else the writer's ledger's (none
        where neither knows)."""
        history = self.history() if callable(self.history) else self.history
        return history or context.history or RunHistory(0, 0.0)

    def due(self, context: SaveContext) -> SaveDecision:
        if context.in_flight:
            return SaveDecision(False)
        least, change = self.min_seconds, None
        if context.save_cost is not None:
            history = self.run_history(context)
            observed = history.seconds + context.session_seconds
            mean_time = cadence.mtbf(history.failures, observed, self.mtbf)
            interval = min(max(cadence.young_daly(context.save_cost, mean_time), self.min_seconds), cadence.MAX_SECONDS)
            change = IntervalChange(
                interval=interval,
                cost=context.save_cost,
                mtbf=mean_time,
                failures=history.failures,
                observed=observed,
                prior=self.mtbf,
                expected_loss=cadence.expected_loss(interval, context.save_cost),
            )
            least = max(least, interval)
        return SaveDecision(context.since_start is None or context.since_start >= least, change)


EVERY_RECORD = EveryRecord()
"""The default policy."""
Every: TypeAlias = "SavePolicy | Literal['continuous', 'auto'] | None"
"""What a writer's `every=` takes: a policy, or the old keywords' strings (deprecated)."""


def is_policy(value: Any) -> bool:
    """Whether `value` is a save policy: it has a `due` method (a class, which has one too, is not)."""
    return not isinstance(value, type) and callable(getattr(value, "due", None))


def from_keywords(owner: str, every: Any, every_seconds: Any, min_seconds: Any, mtbf: Any) -> SavePolicy:
    """The policy that a writer's keywords give (`every=`, `every_seconds=`, `min_seconds=`, `mtbf=`).

    Raises:
        ValueError: an unknown `every`, seconds that are not positive numbers, `every_seconds` with `every`,
            `min_seconds` without it, `mtbf` without `every="auto"`, or a policy with any of the three.
    """
    if is_policy(every):
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
            f"{owner} every must be a save policy (fs.EveryRecord(), fs.EverySeconds(s), "
            "fs.Continuous(min_seconds), fs.AutoInterval(...), or an object of your own with a due(context) method: "
            f"fs.SavePolicy) or None (every record), got {every!r}."
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
    policy: SavePolicy
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
