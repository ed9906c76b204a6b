"""When a writer saves a record: a policy (`flaxstate.checkpoint.policies`) asked at each record.

`SaveSchedule(policy, clock, history)` holds what the policy needs of the run:
the last save's time (`EverySeconds`, `Continuous`), and for `AutoInterval`
the step time of recent records, the windows of recent saves (`SaveWindow`)
and the run's failures (`RunHistory`, handed over by the writer), from which
it chooses the interval by Young and Daly's rule (`flaxstate.run_record.cadence`); each
change of interval is an `IntervalChange`, which the writer logs and keeps in
its ledger.

Final, preempted and requested records are always saved (the writer decides
that). Under several processes the primary process's decision is every
process's (the writer broadcasts it).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from typing import Any

from flaxstate.checkpoint.policies import AutoInterval, Continuous, EveryRecord, EverySeconds, RunHistory, SavePolicy
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


class SaveSchedule:
    """A writer's choice of which records to save, by its policy (see the module).

    Args:
        policy: when to save (`flaxstate.checkpoint.policies`).
        clock: the monotonic clock the seconds are measured on.
        history: the run's failures and seconds of running before this session, where known, asked at each
            decision of an `AutoInterval` (the writer hands over its ledger's, or the policy's own).
    """

    def __init__(
        self,
        policy: SavePolicy,
        clock: Callable[[], float],
        history: Callable[[], RunHistory | None] = lambda: None,
    ) -> None:
        self.policy = policy
        self.auto = isinstance(policy, AutoInterval)
        self.continuous = isinstance(policy, Continuous | AutoInterval)
        """Whether a record is passed over while a save is in flight."""
        self.every_record = isinstance(policy, EveryRecord)
        """Whether every record is saved: nothing to decide."""
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
        """`AutoInterval`'s interval now (seconds), once a save's cost is known."""
        self._logged: float | None = None

    def note(self, checkpoint: Checkpoint) -> None:
        """Notes a record's training (its step time, for the drag of saves in flight meanwhile: `AutoInterval`'s
        cost; other policies keep nothing)."""
        if not self.auto:
            return
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

    def due(self, in_flight: bool) -> tuple[bool, IntervalChange | None]:
        """Whether this process would save the record noted last (`in_flight`: a save of the writer's runs).

        Returns:
            the decision, and `AutoInterval`'s new interval with its inputs where it changed (to log; else `None`).
        """
        now = self._clock()
        if isinstance(self.policy, EverySeconds):
            return now - self._last_save_time >= self.policy.seconds, None
        if not self.continuous:
            return True, None
        if in_flight:
            return False, None
        least = self.policy.min_seconds if isinstance(self.policy, Continuous | AutoInterval) else 0.0
        change = None
        if self.auto:
            change = self._choose(now)
            least = max(least, self.interval or 0.0)
        return self._last_start is None or now - self._last_start >= least, change

    def started(self, step: int, start: float, blocking: float) -> None:
        """Notes a save that started at `start` (on the clock) and blocked its call `blocking` seconds."""
        self._last_start = start
        self._last_save_time = self._clock()
        if self.auto:
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

    def _choose(self, now: float) -> IntervalChange | None:
        assert isinstance(self.policy, AutoInterval)
        cost = self.save_cost()
        if cost is None:
            return None
        history = self._history() or RunHistory(0, 0.0)
        observed = history.seconds + (now - self._created)
        mean_time = cadence.mtbf(history.failures, observed, self.policy.mtbf)
        chosen = cadence.young_daly(cost, mean_time)
        self.interval = min(max(chosen, self.policy.min_seconds), cadence.MAX_SECONDS)
        if self._logged is not None and abs(self.interval - self._logged) <= RELOG * self._logged:
            return None
        self._logged = self.interval
        return IntervalChange(
            interval=self.interval,
            cost=cost,
            mtbf=mean_time,
            failures=history.failures,
            observed=observed,
            prior=self.policy.mtbf,
            expected_loss=cadence.expected_loss(self.interval, cost),
        )
