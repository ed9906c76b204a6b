"""When a writer saves a record: every record, every few seconds, continuously, or at an interval from the run.

`CheckpointFileWriter(every=..., every_seconds=..., min_seconds=..., mtbf=...)`:

- `every=None`, `every_seconds=None` (the default): every record it is given.
- `every_seconds=S`: a record once S seconds have passed since the last save
  (or since the writer was made).
- `every="continuous"`: a record whenever no save of the writer's is in flight
  and at least `min_seconds` have passed since the last one started; a record
  that comes while a save runs is passed over, so the loop never waits for a
  save (orbax's `ContinuousCheckpointingPolicy`, MaxText's
  `enable_continuous_checkpointing`).
- `every="auto"`: as continuously, at an interval chosen by Young and Daly's
  rule from the save's measured cost to the training (what the writer's call
  blocked plus the drag of the save in the background: the records' step
  time while it ran against while none did) and the failure rate seen in the
  run's goodput ledger, with `mtbf=` seconds as a prior; bounded below by
  `min_seconds` and above by `flaxstate.cadence.MAX_SECONDS`. Each change of
  interval is logged with its inputs (and kept in the ledger).

Final, preempted and requested records are always saved (the writer decides
that). Under several processes the primary process's decision is every
process's (the writer broadcasts it).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any, Literal

from flaxstate import cadence, settings
from flaxstate.records import Checkpoint

Every = Literal["continuous", "auto"] | None
MODES = ("continuous", "auto")
RECENT_RECORDS = 64
"""The records whose step time the drag of recent saves is measured on."""
RECENT_SAVES = 8
"""The saves whose cost `every="auto"` averages (so it follows a cost that changes)."""
RELOG = 0.1
"""`every="auto"` logs its interval again when it moved by more than this fraction."""


def _optional_seconds(owner: str, name: str, value: Any, zero: bool = False) -> float | None:
    if zero and settings.is_real(value) and value == 0:
        return 0.0
    return settings.optional_seconds(owner, name, value)


class SaveSchedule:
    """A writer's choice of which records to save (see the module).

    Args:
        owner: the writer's name, for errors.
        every: `None`, `"continuous"` or `"auto"`.
        every_seconds: seconds between saves (with `every=None` only).
        min_seconds: the least seconds between the starts of two saves (with `every`).
        mtbf: a prior of the mean seconds between failures (with `every="auto"`).
        clock: the monotonic clock the seconds are measured on.
        history: the run's failures and seconds of running before this
            session, where known (`flaxstate.checkpoint.ledger.history`), asked
            at each decision.

    Raises:
        ValueError: an unknown `every`, seconds that are not positive numbers,
            `every_seconds` with `every`, `min_seconds` without it, `mtbf` without `every="auto"`.
    """

    def __init__(
        self,
        owner: str,
        every: Every,
        every_seconds: float | None,
        min_seconds: float | None,
        mtbf: float | None,
        clock: Callable[[], float],
        history: Callable[[], tuple[int, float] | None] = lambda: None,
    ) -> None:
        if every is not None and every not in MODES:
            raise ValueError(
                f"{owner} every must be None (every record), 'continuous' or 'auto', got {every!r}; "
                "every_seconds= saves at a fixed time interval."
            )
        self.every_seconds = _optional_seconds(owner, "every_seconds", every_seconds)
        self.min_seconds = _optional_seconds(owner, "min_seconds", min_seconds, zero=True)
        self.mtbf = _optional_seconds(owner, "mtbf", mtbf)
        if every is not None and self.every_seconds is not None:
            raise ValueError(
                f"{owner} got every={every!r} and every_seconds={every_seconds!r}: both set when to save. Give "
                f"one; min_seconds= is the least time between saves with every={every!r}."
            )
        if every is None and self.min_seconds is not None:
            raise ValueError(
                f"{owner} got min_seconds={min_seconds!r} without every=: it bounds every='continuous' and "
                "every='auto'. Add one, or give every_seconds= for a fixed interval."
            )
        if every != "auto" and self.mtbf is not None:
            raise ValueError(
                f"{owner} got mtbf={mtbf!r} with every={every!r}: the mean time between failures chooses "
                "every='auto''s interval. Add every='auto', or leave mtbf out."
            )
        self.every = every
        self._clock = clock
        self._history = history
        self._created = clock()
        self._last_start: float | None = None
        """When the newest save started (on the clock), or `None` before the first."""
        self._last_save_time = self._created
        """When the newest save call returned (every_seconds counts from it), or the writer's creation."""
        self._intervals: collections.deque[cadence.Interval] = collections.deque(maxlen=RECENT_RECORDS)
        self._windows: collections.deque[list[Any]] = collections.deque(maxlen=RECENT_SAVES)
        """`[step, start, end or None, blocking, cost or None]` of the newest saves: `end` once known complete,
        `cost` once a record after it came (then fixed: a save's figure does not move with later records)."""
        self.interval: float | None = None
        """`every="auto"`'s interval now (seconds), once a save's cost is known."""
        self._logged: float | None = None

    def note(self, checkpoint: Checkpoint) -> None:
        """Notes a record's training (its step time, for the drag of saves in flight meanwhile: `every="auto"`'s
        cost; other schedules keep nothing)."""
        if self.every != "auto":
            return
        interval = cadence.Interval.ending(
            self._clock(), checkpoint.elapsed_time, checkpoint.productive_time, checkpoint.n_completed_steps
        )
        self._intervals.append(interval)
        self._settle(interval.start)

    def _settle(self, after: float) -> None:
        """Fixes the cost of each save that ended before `after` (a record trained wholly after it has come):
        its blocking plus the drag of the records that it overlapped, against the clean records seen so far."""
        ended = [window for window in self._windows if window[2] is not None and window[4] is None]
        if not any(window[2] <= after for window in ended):
            return
        intervals = list(self._intervals)
        spans = [(begin, end if end is not None else math.inf) for _, begin, end, _, _ in self._windows]
        drags = cadence.save_drag(intervals, spans)
        for window in ended:
            if window[2] <= after:
                _, begin, end, blocking, _ = window
                overlapped = [
                    drag for each, drag in zip(intervals, drags, strict=True) if each.end > begin and each.start < end
                ]
                window[4] = blocking + sum(overlapped)

    def due(self, in_flight: bool) -> tuple[bool, dict[str, Any] | None]:
        """Whether this process would save the record noted last (`in_flight`: a save of the writer's runs).

        Returns:
            the decision, and `every="auto"`'s new interval with its inputs
            where it changed (to log; else `None`).
        """
        now = self._clock()
        if self.every is None:
            return self.every_seconds is None or now - self._last_save_time >= self.every_seconds, None
        if in_flight:
            return False, None
        least = self.min_seconds or 0.0
        change = None
        if self.every == "auto":
            change = self._choose(now)
            least = max(least, self.interval or 0.0)
        return self._last_start is None or now - self._last_start >= least, change

    def started(self, step: int, start: float, blocking: float) -> None:
        """Notes a save that started at `start` (on the clock) and blocked its call `blocking` seconds."""
        self._last_start = start
        self._last_save_time = self._clock()
        if self.every == "auto":
            self._windows.append([step, start, None, blocking, None])

    def completed(self, completed: tuple[int, float | None] | None) -> None:
        """Notes the newest save known complete, `(step, seconds from start to end)` (the store's `completed`)."""
        if completed is None or completed[1] is None:
            return
        for window in self._windows:
            if window[0] == completed[0] and window[2] is None:
                window[2] = window[1] + completed[1]

    def save_cost(self) -> float | None:
        """The seconds of training a recent save cost, averaged: its call's blocking plus its drag (a save still
        running, or whose drag is not known yet, counts its blocking); `None` before the first save."""
        if not self._windows:
            return None
        return sum(window[4] if window[4] is not None else window[3] for window in self._windows) / len(self._windows)

    def _choose(self, now: float) -> dict[str, Any] | None:
        cost = self.save_cost()
        if cost is None:
            return None
        failures, before = self._history() or (0, 0.0)
        observed = before + (now - self._created)
        mean_time = cadence.mtbf(failures, observed, self.mtbf)
        chosen = cadence.young_daly(cost, mean_time)
        self.interval = min(max(chosen, self.min_seconds or 0.0), cadence.MAX_SECONDS)
        if self._logged is not None and abs(self.interval - self._logged) <= RELOG * self._logged:
            return None
        self._logged = self.interval
        return {
            "interval": self.interval,
            "cost": cost,
            "mtbf": mean_time,
            "failures": failures,
            "observed": observed,
            "prior": self.mtbf,
            "expected_loss": cadence.expected_loss(self.interval, cost),
        }


def line(change: dict[str, Any], owner: str) -> str:
    """The log line of a change of `every="auto"`'s interval, with its inputs."""
    prior = "" if change["prior"] is None else f", prior mtbf={change['prior']:.0f} s"
    rule = cadence.young_daly(change["cost"], change["mtbf"])
    bounded = "" if math.isclose(change["interval"], rule) else f" (bounded; the rule gives {rule:.1f} s)"
    return (
        f"{owner}: saving every {change['interval']:.1f} s{bounded} = sqrt(2 x {change['cost']:.3f} s a save costs "
        f"x {change['mtbf']:.0f} s between failures: {change['failures']} in {change['observed']:.0f} s of running"
        f"{prior}); a failure is expected to lose {change['expected_loss']:.1f} s"
    )
