"""When a writer saves a record: what the writer measures for its policy (`flaxstate.checkpoint.policies`), which
decides at each record.

`SaveSchedule(policy, clock, history)` holds what the run measured: the last
save's start and end, the step time of recent records and the windows of
recent saves (`SaveWindow`), from which a save's cost to the training comes
(its blocking plus its drag), and the run's failures before this session
(`RunHistory`, handed in by the writer from its ledger). At each record it
hands them to the policy as one frozen `SaveContext`, and the policy decides
(`SavePolicy.due`); an `AutoInterval` chooses its interval from them by
Young and Daly's rule (`flaxstate.run_record.cadence`), and each change of
interval is an `IntervalChange`, which the writer logs and keeps in its
ledger.

Final, preempted and requested records are always saved (the writer decides
that). Under several processes the primary process's decision is every
process's (the writer broadcasts it).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable

import numpy as np

from flaxstate.checkpoint.policies import IntervalChange, RunHistory, SaveContext, SaveDecision, SavePolicy
from flaxstate.records import Checkpoint
from flaxstate.run_record import cadence

RECENT_RECORDS = 64
"""The records whose step time the drag of recent saves is measured on."""
RECENT_SAVES = 8
"""The saves whose cost `AutoInterval` averages (so it follows a cost that changes)."""
RELOG = 0.1
"""`AutoInterval` logs its interval again when it moved by more than this fraction."""


@dataclasses.dataclass
class SaveWindow:
    """A recent save, as `AutoInterval` measures its cost (filled in as the save and the records after it go)."""

    step: int
    start: float
    """When it started, on the schedule's clock."""
    blocking: float
    """The seconds its call blocked the caller."""
    end: float | None = None
    """When it ended, once known complete."""
    cost: float | None = None
    """Its seconds of training lost (blocking plus drag), once a record after it came; then fixed."""


class SaveSchedule:
    """A writer's choice of which records to save, by its policy (see the module).

    Args:
        policy: when to save (`flaxstate.checkpoint.policies`).
        clock: the monotonic clock the seconds are measured on.
        history: the run's failures and seconds of running before this session, where known (the writer's
            ledger's), asked at each decision.
    """

    def __init__(
        self,
        policy: SavePolicy,
        clock: Callable[[], float],
        history: Callable[[], RunHistory | None] = lambda: None,
    ) -> None:
        self.policy = policy
        self.broadcast = bool(getattr(policy, "broadcast", True))
        """Whether the primary process's decision is every process's (the writer broadcasts it)."""
        self._clock = clock
        self._history = history
        self._created = clock()
        self._last_start: float | None = None
        """When the newest save started (on the clock), or `None` before the first."""
        self._last_save_time = self._created
        """When the newest save call returned (`EverySeconds` counts from it), or the writer's creation."""
        self._intervals: collections.deque[cadence.Interval] = collections.deque(maxlen=RECENT_RECORDS)
        self._windows: collections.deque[SaveWindow] = collections.deque(maxlen=RECENT_SAVES)
        self.interval: float | None = None
        """The interval the policy chose last (seconds; `AutoInterval`'s, once a save's cost is known)."""
        self._logged: float | None = None

    def note(self, checkpoint: Checkpoint) -> None:
        """Notes a record's training (its step time, for the drag of saves in flight meanwhile: a save's cost)."""
        interval = cadence.Interval.ending(
            self._clock(), checkpoint.elapsed_time, checkpoint.productive_time, checkpoint.n_completed_steps
        )
        self._intervals.append(interval)
        self._settle(interval.start)

    def _settle(self, after: float) -> None:
        """Fixes the cost of each save that ended before `after` (a record trained wholly after it has come):
        its blocking plus the drag of the records that it overlapped, against the clean records seen so far."""
        ended = [window for window in self._windows if window.end is not None and window.cost is None]
        if not any(window.end <= after for window in ended if window.end is not None):
            return
        intervals = list(self._intervals)
        spans = [(window.start, math.inf if window.end is None else window.end) for window in self._windows]
        drags = cadence.save_drag(intervals, spans)
        for window in ended:
            if window.end is not None and window.end <= after:
                overlapped = [
                    drag
                    for each, drag in zip(intervals, drags, strict=True)
                    if each.end > window.start and each.start < window.end
                ]
                window.cost = window.blocking + sum(overlapped)

    def context(self, in_flight: bool) -> SaveContext:
        """What was measured now, for the policy (`in_flight`: a save of the writer's runs)."""
        now = self._clock()
        return SaveContext(
            now=now,
            session_seconds=now - self._created,
            since_save=now - self._last_save_time,
            since_start=None if self._last_start is None else now - self._last_start,
            in_flight=in_flight,
            save_cost=self.save_cost(),
            history=self._history(),
        )

    def due(self, in_flight: bool) -> tuple[bool, IntervalChange | None]:
        """Whether this process would save the record noted last (`in_flight`: a save of the writer's runs).

        Returns:
            the policy's decision, and the interval it chose where that moved by more than `RELOG` since it was
            last logged (to log; else `None`).

        Raises:
            TypeError: the policy's `due` answered neither a bool nor a `SaveDecision`.
        """
        decision = self.policy.due(self.context(in_flight))
        if isinstance(decision, bool | np.bool_):
            return bool(decision), None
        if not isinstance(decision, SaveDecision):
            raise TypeError(
                f"the save policy {self.policy!r}'s due() returned {decision!r}; it must return True, False or a "
                "fs.SaveDecision."
            )
        change = decision.interval
        if change is not None:
            self.interval = change.interval
            if self._logged is not None and abs(change.interval - self._logged) <= RELOG * self._logged:
                change = None
            else:
                self._logged = change.interval
        return decision.save, change

    def started(self, step: int, start: float, blocking: float) -> None:
        """Notes a save that started at `start` (on the clock) and blocked its call `blocking` seconds."""
        self._last_start = start
        self._last_save_time = self._clock()
        self._windows.append(SaveWindow(step, start, blocking))

    def completed(self, completed: tuple[int, float | None] | None) -> None:
        """Notes the newest save known complete, `(step, seconds from start to end)` (the store's `completed`)."""
        if completed is None or completed[1] is None:
            return
        for window in self._windows:
            if window.step == completed[0] and window.end is None:
                window.end = window.start + completed[1]

    def save_cost(self) -> float | None:
        """The seconds of training a recent save cost, averaged: its call's blocking plus its drag (a save still
        running, or whose drag is not known yet, counts its blocking); `None` before the first save."""
        if not self._windows:
            return None
        costs = [window.blocking if window.cost is None else window.cost for window in self._windows]
        return sum(costs) / len(costs)
