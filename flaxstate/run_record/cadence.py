"""How often to save, from a run's own figures: Young and Daly's interval, the failure rate, and a save's drag.

Pure functions of what the goodput ledger measures (`flaxstate.run_record.goodput` adds
the drag up for a report; `flaxstate.checkpoint.schedule` chooses a writer's
interval live from the same figures):

- `young_daly(cost, mtbf)`: the interval between saves that loses the least
  time, `sqrt(2 * cost * mtbf)` (Young 1974, Daly 2006), for a save that
  costs the training `cost` seconds and a job that fails every `mtbf`
  seconds on average.
- `mtbf(failures, observed, prior)`: the mean time between failures seen
  over `observed` seconds of running, with a prior.
- `save_drag(intervals, windows)`: the training time that saves running in
  the background cost: the records' step time while a save was in flight,
  against the records' step time while none was.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

from flaxstate import settings


@dataclasses.dataclass(frozen=True)
class RunHistory:
    """A run's failures and seconds of running before this session, from its goodput ledger.

    Args:
        failures: the sessions that ended without their final or preempted record.
        seconds: the seconds that those earlier sessions ran.

    Raises:
        ValueError: a negative or non-integer `failures`, or `seconds` negative or not finite.
    """

    failures: int
    seconds: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "failures", settings.count("RunHistory", "failures", self.failures, minimum=0))
        if not settings.is_real(self.seconds) or not math.isfinite(self.seconds) or self.seconds < 0:
            raise ValueError(f"RunHistory seconds must be a finite number of seconds, 0 or more, got {self.seconds!r}.")
        object.__setattr__(self, "seconds", float(self.seconds))


MAX_SECONDS = 3600.0
"""The longest interval `AutoInterval` chooses (a run that never fails still saves once an hour)."""


def young_daly(cost: float, mtbf: float) -> float:
    """The interval between saves that loses the least time: `sqrt(2 * cost * mtbf)` seconds.

    Args:
        cost: the seconds of training that one save costs (what it blocks, and its drag).
        mtbf: the mean seconds between failures.
    """
    return math.sqrt(2.0 * max(cost, 0.0) * max(mtbf, 0.0))


def mtbf(failures: int, observed: float, prior: float | None = None) -> float:
    """The mean time between failures: `observed` seconds of running over the `failures` seen in them.

    A prior counts as one more failure-free stretch of `prior` seconds that
    ended in a failure, so it rules until failures are seen and fades as they
    come: `(observed + prior) / (failures + 1)`. Without a prior and before
    any failure the run's time so far is the estimate (it has run that long
    without one).
    """
    observed = max(observed, 0.0)
    if prior is not None:
        return (observed + prior) / (failures + 1)
    return observed / failures if failures else observed


def expected_loss(interval: float, cost: float) -> float:
    """The progress a failure costs on average when saves come every `interval` seconds and each costs `cost`:
    half an interval of steps trained again, plus the save that was in flight (Young's first-order model)."""
    return interval / 2.0 + max(cost, 0.0)


@dataclasses.dataclass(frozen=True)
class Interval:
    """A record's training on one clock: from `start` to `end`, `productive` seconds of it stepping, `steps` steps."""

    start: float
    end: float
    productive: float
    steps: int

    @classmethod
    def ending(cls, end: float, elapsed: float, productive: float, steps: int) -> Interval:
        """A record's interval from what it logs: its own training, the `elapsed` seconds up to `end` (not the
        caller's time before it, in which a save can drag no step)."""
        return cls(end - elapsed, end, productive, steps)


def overlap(start: float, end: float, windows: Sequence[tuple[float, float]]) -> float:
    """Seconds of `[start, end]` inside any of `windows` (each `(start, end)`; they do not overlap each other)."""
    return sum(max(0.0, min(end, stop) - max(start, begin)) for begin, stop in windows)


def save_drag(intervals: Sequence[Interval], windows: Sequence[tuple[float, float]]) -> list[float]:
    """The training time each interval lost to a save running in the background, in seconds.

    The clean step time is the median of the intervals that no save
    overlapped; an interval that a save overlapped lost its productive time
    beyond its steps at the clean step time. Slower and faster intervals both
    count (noise cancels over many), and each interval's figure is the
    excess of the whole run's overlapped intervals shared in proportion,
    clipped at zero in total: a run whose saves cost nothing gets zeros.

    Args:
        intervals: the records' training, oldest first.
        windows: each save's `(start, end)` on the intervals' clock, while it ran in the background.

    Returns:
        one figure an interval; all zero where no interval is clean (nothing to compare with).
    """
    overlaps = [overlap(each.start, each.end, windows) for each in intervals]
    pairs = list(zip(intervals, overlaps, strict=True))
    clean = [each.productive / each.steps for each, over in pairs if not over and each.steps]
    if not clean:
        return [0.0] * len(intervals)
    step_time = statistics.median(clean)
    excess = [each.productive - each.steps * step_time if over and each.steps else 0.0 for each, over in pairs]
    total = sum(excess)
    if total <= 0.0:
        return [0.0] * len(intervals)
    positive = sum(value for value in excess if value > 0)
    return [total * value / positive if value > 0 else 0.0 for value in excess]
