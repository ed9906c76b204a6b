"""The watchdog: a stuck loop becomes a diagnosed exit that a scheduler restarts, instead of a silent hang.

A run can wait forever without an error: a peer process stopped (not
killed: `SIGSTOP`, a swapping host, a hung driver) leaves the others in a
collective; a data reader blocks on a network file; a save never completes.
`TrainLoop(hang_timeout=...)` runs a `Watchdog` thread that looks, once a
second, for progress of the loop while the loop has control (from a call's
start to its record, and the saves the loop waits for at its end; not the
caller's code between records): a batch drawn, a dispatch returned, a
dispatched step finished on the devices, a record made. The loop's part is
a store to memory (a counter and the name of what it waits for); the
thread reads the clock and asks the devices (`jax.Array.is_ready`).

When nothing progressed for the timeout, the watchdog writes to stderr,
in this order: one line saying what the loop waited for, at which step and
since when; the stacks of every thread (`faulthandler`); what to do. Then it
ends the process with `EXIT_STATUS` (75, `EX_TEMPFAIL`: "try again"), which
a job scheduler can restart on; the restarted run resumes from its last
checkpoint, exactly. In an interactive session (a REPL, a notebook) it
reports and leaves the process alone.

The default, `"auto"`, fires after `max(FLOOR_SECONDS, GAP_MULTIPLE x the
longest wait between two signs of progress seen so far)`, and after
`SLOW_FLOOR_SECONDS` while the loop compiles or restores (a big model's
compilation or restore can take many minutes, once). So no healthy run meets
it: a run whose steps or evaluations take long has shown long gaps before
and the bar rises with them. A number is honoured as given, in every phase.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

import jax

EXIT_STATUS = 75
"""The exit status of a process that the watchdog ends (`EX_TEMPFAIL` of sysexits.h: restart me)."""
FLOOR_SECONDS = 600.0
"""`"auto"`: the least time without progress that fires (ten minutes)."""
GAP_MULTIPLE = 10.0
"""`"auto"`: fires after this many times the longest wait between two signs of progress seen so far."""
SLOW_FLOOR_SECONDS = 3600.0
"""`"auto"`: the least time that fires while the loop compiles or restores."""
SLOW_PHASES = ("compiling", "restoring")
"""Phases (by their first word) that `"auto"` gives `SLOW_FLOOR_SECONDS`."""
LOOK_SECONDS = 1.0
"""How often the thread looks (at most; less for a timeout below 4 s)."""

HangTimeout = float | Literal["auto"] | None


def check_timeout(hang_timeout: Any) -> HangTimeout:
    """Returns a valid `hang_timeout`.

    Raises:
        ValueError: neither `"auto"`, `None` nor a positive number of seconds.
    """
    if hang_timeout is None or hang_timeout == "auto":
        return hang_timeout
    if isinstance(hang_timeout, bool) or not isinstance(hang_timeout, int | float) or not hang_timeout > 0:
        raise ValueError(
            f"TrainLoop hang_timeout must be a positive number of seconds, 'auto' or None (no watchdog), "
            f"got {hang_timeout!r}."
        )
    return float(hang_timeout)


def interactive() -> bool:
    """Whether this process is an interactive session: a REPL (`python -i` included) or a Jupyter kernel."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or "ipykernel" in sys.modules


class Watchdog:
    """Watches a loop's progress from a thread (see the module's docstring).

    The loop's side: `watching()` around the spans it has control; `beats`
    (add one on progress), `phase` and `step` (what it does now), stores
    only; `outputs`, the newest dispatches' outputs, whose readiness the
    thread reads as the devices' progress.

    Args:
        timeout: seconds without progress, `"auto"`, or `None` (no thread).
        exit_process: end the process when it fires (else report only); by
            default, unless the session is interactive.
    """

    def __init__(self, timeout: HangTimeout, exit_process: bool | None = None) -> None:
        self.timeout = timeout
        self.exit_process = (not interactive()) if exit_process is None else exit_process
        self.beats = 0
        self.phase = "starting"
        self.step = 0
        self.outputs: collections.deque[Any] = collections.deque(maxlen=64)
        """The newest dispatches' outputs (appended by the loop): their readiness is the devices' progress."""
        self.fired = False
        self._armed = 0
        self._longest_gap = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self, phase: str | None = None) -> Iterator[None]:
        """Watches the block (nested blocks share the watch); `phase`: what the loop does in it."""
        if self.timeout is None:
            yield
            return
        if self._thread is None:
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(self._stop,), name="flaxstate-watchdog", daemon=True
            )
            self._thread.start()
        if phase is not None:
            self.phase = phase
        self.beats += 1
        self._armed += 1
        try:
            yield
        finally:
            self._armed -= 1
            self.beats += 1

    def close(self) -> None:
        """Stops the thread (a later `watching()` starts another)."""
        self._stop.set()
        self._thread = None

    def limit(self, phase: str) -> float:
        """The seconds without progress that fire in `phase`."""
        if self.timeout is None:
            return float("inf")
        if self.timeout != "auto":
            return float(self.timeout)
        if phase.split(" ", 1)[0] in SLOW_PHASES:
            return max(SLOW_FLOOR_SECONDS, GAP_MULTIPLE * self._longest_gap)
        return max(FLOOR_SECONDS, GAP_MULTIPLE * self._longest_gap)

    def _devices_done(self) -> int:
        """How many of the newest dispatches the devices finished (a flag read each)."""
        done = 0
        for output in list(self.outputs):
            try:
                done += bool(output.is_ready())
            except Exception:  # noqa: BLE001  a deleted or donated output: its work is done
                done += 1
        return done

    def _run(self, stop: threading.Event) -> None:
        seen = (self.beats, self._devices_done(), self.phase)
        since = time.monotonic()
        reported = False
        while not stop.wait(min(LOOK_SECONDS, float(self.limit(self.phase)) / 4)):
            now = time.monotonic()
            current = (self.beats, self._devices_done(), self.phase)
            if current != seen or not self._armed:
                if self._armed and current[:2] != seen[:2]:
                    self._longest_gap = max(self._longest_gap, now - since)
                seen, since, reported = current, now, False
                continue
            waited = now - since
            if waited >= self.limit(self.phase) and not reported:
                self._fire(waited, time.time() - waited)
                reported = True

    def _fire(self, waited: float, since_wall: float) -> None:
        self.fired = True
        stderr = sys.__stderr__ or sys.stderr
        started = time.strftime("%H:%M:%S", time.localtime(since_wall))
        process = f"process {jax.process_index()}: " if jax.process_count() > 1 else ""
        print(
            f"flaxstate watchdog: {process}no progress for {waited:.0f} s at step {self.step}: "
            f"{self.phase} (since {started}).",
            file=stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=stderr, all_threads=True)
        if self.exit_process:
            advice = (
                f"The process now exits with status {EXIT_STATUS} (EX_TEMPFAIL) so that its scheduler restarts "
                "it; a restarted run resumes from its last checkpoint. If this wait was healthy, raise "
                "TrainLoop(hang_timeout=...) or turn the watchdog off with hang_timeout=None."
            )
        else:
            advice = (
                "Interactive session: the process is left running. Interrupt it (Ctrl-C) if it is stuck; "
                "hang_timeout=None turns the watchdog off."
            )
        print(f"flaxstate watchdog: {advice}", file=stderr, flush=True)
        if self.exit_process:
            os._exit(EXIT_STATUS)
