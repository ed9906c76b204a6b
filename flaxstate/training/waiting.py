"""How long the devices wait for the host, seen without a sync.

JAX dispatches asynchronously: while the devices run one dispatch, the host
draws the next batches and dispatches again. A batch drawn while the
devices still compute costs nothing; time costs only where the devices have
finished all the work given to them and wait for the next dispatch. The
clock looks at the newest dispatch's output with `jax.Array.is_ready()` (a
flag read, not a sync) when a batch has been drawn and when the host
dispatches, and counts:

- idle time: from the start of the draw at whose end the devices were first
  seen idle (or from the look at dispatch time) up to the next dispatch;
- data time: the part of it spent drawing batches.

Both are seen at draw and dispatch boundaries only: a draw that outlasts
the devices' work counts whole (so near the balance of host and devices they
read high), and idle time outside any draw is counted from the first look
that sees it. Compilation, inside the dispatch call, is not counted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@dataclasses.dataclass
class WaitTimes:
    """Seconds the devices waited for the host, and for the data in particular, within one record's segment."""

    idle: float = 0.0
    data: float = 0.0


class DeviceWaitClock:
    """Counts the devices' wait for the host into a segment's `WaitTimes`, from draw and dispatch boundaries."""

    def __init__(self) -> None:
        self._newest: Any = None  # a jax.Array (`is_ready`, which JAX's stubs do not name)
        """An output of the newest dispatch: ready once the devices finished everything given."""
        self._idle_since: float | None = None
        """When the devices were first seen idle since the newest dispatch (None: not seen idle)."""

    def _idle(self) -> bool:
        return self._newest is None or self._newest.is_ready()

    def resume(self, now: float) -> None:
        """Starts looking at `now`, when a segment starts or resumes (the devices may be idle since)."""
        self._idle_since = now if self._idle() else None

    def drew(self, start: float, end: float, times: WaitTimes) -> None:
        """Counts a batch drawn from `start` to `end` as data time if the devices were idle by its end."""
        if self._idle_since is None and self._idle():
            self._idle_since = start
        if self._idle_since is not None:
            times.data += end - max(start, self._idle_since)

    def dispatching(self, now: float, times: WaitTimes) -> None:
        """Ends the devices' wait at `now`, when the host dispatches again."""
        if self._idle_since is not None:
            times.idle += now - self._idle_since
        self._idle_since = None

    def dispatched(self, output: jax.Array) -> None:
        """Notes an output of the dispatch just made: the devices are busy until it is ready."""
        self._newest = output
        self._idle_since = None
