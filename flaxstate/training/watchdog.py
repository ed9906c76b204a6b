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
reports and leaves the process alone. A debugger stopped in any thread
(`pdb`, `breakpoint()`, ipdb, any `bdb` debugger) is a person at work: no
time counts while it holds a prompt, and nothing is reported.

What the loop waits for is a `Phase`, a value that carries its own
allowance; its message is text for people, which may be reworded freely.

The default, `"auto"`, fires after `max(FLOOR_SECONDS, GAP_MULTIPLE x the
longest wait between two signs of progress seen so far)`, and after
`SLOW_FLOOR_SECONDS` in the slow phases, where the loop compiles or restores (a big model's
compilation or restore can take many minutes, once). So no healthy run meets
it: a run whose steps or evaluations take long has shown long gaps before
and the bar rises with them. A number is honoured as given, in every phase.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import enum
import faulthandler
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal
from weakref import WeakSet

import jax

from flaxstate import settings

EXIT_STATUS = 75
"""The exit status of a process that the watchdog ends (`EX_TEMPFAIL` of sysexits.h: restart me)."""
FLOOR_SECONDS = 600.0
"""`"auto"`: the least time without progress that fires (ten minutes)."""
GAP_MULTIPLE = 10.0
"""`"auto"`: fires after this many times the longest wait between two signs of progress seen so far."""
SLOW_FLOOR_SECONDS = 3600.0
"""`"auto"`: the least time that fires while the loop compiles or restores (a slow `Phase`)."""
LOOK_SECONDS = 1.0
"""How often the thread looks (at most; less for a timeout below 4 s)."""

JOIN_SECONDS = 10.0
"""How long `close` waits for the thread (a look takes microseconds; the bound keeps a wedged one from hanging)."""

HangTimeout = float | Literal["auto"] | None


class Phase(enum.Enum):
    """What the loop waits for, each with its allowance under `"auto"` (`floor_seconds`) and a message.

    Slow phases (the loop compiles or restores) get `SLOW_FLOOR_SECONDS`, the
    others `FLOOR_SECONDS`; the message is what the diagnosis says, with the
    detail the loop gives (a step, a dispatch's size) after it.
    """

    STARTING = ("starting", False)
    RESTORING = ("restoring the checkpoint and moving the data to its position", True)
    COMPILING_STATE = ("compiling the state's creation", True)
    COMPILING_ONE_STEP = ("compiling the one-step update (and counting its FLOPs)", True)
    COMPILING_UPDATE = ("compiling the update", True)
    WAITING_FOR_DATA = ("waiting for the data", False)
    DISPATCHING = ("dispatching", False)
    WAITING_FOR_DEVICES = ("waiting for the devices to finish", False)
    AGREEING_ON_RECORD = ("agreeing with the other processes on the record", False)
    WAITING_FOR_SAVES = ("waiting for the saves to finish", False)

    def __init__(self, message: str, slow: bool) -> None:
        self.message = message
        self.slow = slow

    @property
    def floor_seconds(self) -> float:
        """The least time without progress that fires in this phase under `"auto"`."""
        return SLOW_FLOOR_SECONDS if self.slow else FLOOR_SECONDS


def check_timeout(hang_timeout: Any) -> HangTimeout:
    """Returns a valid `hang_timeout`.

    Raises:
        ValueError: neither `"auto"`, `None` nor a positive number of seconds.
    """
    if hang_timeout is None:
        return None
    if isinstance(hang_timeout, str) and hang_timeout == "auto":
        return "auto"
    if not settings.is_real(hang_timeout):
        raise ValueError(
            f"TrainLoop hang_timeout must be a positive number of seconds, 'auto' or None (no watchdog), "
            f"got {hang_timeout!r} ({type(hang_timeout).__name__})."
        )
    if not math.isfinite(hang_timeout) or not hang_timeout > 0:
        raise ValueError(
            f"TrainLoop hang_timeout must be a positive number of seconds, 'auto' or None (no watchdog), "
            f"got {hang_timeout!r}."
        )
    return float(hang_timeout)


def interactive() -> bool:
    """Whether this process is an interactive session: a REPL (`python -i` included) or a Jupyter kernel."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or "ipykernel" in sys.modules


def debugger_attached() -> bool:
    """Whether a `bdb` debugger (pdb, ipdb, `breakpoint()`) traces a frame of any thread: a person at work."""
    bdb = sys.modules.get("bdb")
    if bdb is None:
        return False
    for top in list(sys._current_frames().values()):
        frame: Any = top
        while frame is not None:
            if isinstance(getattr(frame.f_trace, "__self__", None), bdb.Bdb):
                return True
            frame = frame.f_back
    return False


class Watchdog:
    """Watches a loop's progress from a thread (see the module's docstring).

    The loop tells it, by stores to memory only: `watching()` around the
    spans it has control; `enter(phase, ...)`, what it waits for now;
    `beat()`, a sign of progress (a batch drawn, a record made);
    `dispatched(output)`, a dispatch returned, whose output's readiness the
    thread reads as the devices' progress.

    Args:
        timeout: seconds without progress, `"auto"`, or `None` (no thread).
        exit_process: end the process when it fires (else report only); by
            default, unless the session is interactive.
    """

    def __init__(self, timeout: HangTimeout, exit_process: bool | None = None) -> None:
        self.timeout = timeout
        self.exit_process = (not interactive()) if exit_process is None else exit_process
        self._beats = 0
        self._phase = Phase.STARTING
        self._detail = ""
        self._step = 0
        self._outputs: collections.deque[Any] = collections.deque(maxlen=64)
        """The newest dispatches' outputs: their readiness is the devices' progress."""
        self.fired = False
        self._armed = 0
        self._longest_gap = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def phase(self) -> Phase:
        """What the loop waits for now."""
        return self._phase

    def enter(self, phase: Phase, detail: str = "", step: int | None = None) -> None:
        """Says what the loop waits for now (`detail` follows the phase's message), at `step` if given."""
        self._phase, self._detail = phase, detail
        if step is not None:
            self._step = step

    def beat(self) -> None:
        """A sign of progress: a batch drawn, a record made."""
        self._beats += 1

    def dispatched(self, output: Any) -> None:
        """A dispatch returned: a sign of progress, and its `output`'s readiness the devices' progress."""
        self._beats += 1
        self._outputs.append(output)

    @contextlib.contextmanager
    def watching(self, phase: Phase | None = None) -> Iterator[None]:
        """Watches the block (nested blocks share the watch); `phase`: what the loop does in it."""
        if self.timeout is None:
            yield
            return
        if self._thread is None:
            self._stop = threading.Event()
            thread = threading.Thread(target=self._run, args=(self._stop,), name="flaxstate-watchdog", daemon=True)
            thread.start()  # then kept: a Ctrl-C inside `start` leaves no thread that is never started
            self._thread = thread
            _RUNNING.add(self)
        if phase is not None:
            self.enter(phase)
        self._beats += 1
        self._armed += 1
        try:
            yield
        finally:
            self._armed -= 1
            self._beats += 1

    def close(self) -> None:
        """Stops the thread and waits for it to end (a later `watching()` starts another).

        A daemon thread still asking the devices (`is_ready`) when the
        interpreter tears down is killed inside jaxlib, and that aborts the
        process; so the thread ends here, before the caller goes on (and at
        exit, see `_close_all`).
        """
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            try:
                thread.join(JOIN_SECONDS)
            except RuntimeError:  # not started yet (a Ctrl-C inside `start`): it sees the stop at once
                pass
        _RUNNING.discard(self)
        self._outputs.clear()  # the devices' arrays are not held past the watch

    def limit(self, phase: Phase) -> float:
        """The seconds without progress that fire in `phase`."""
        if self.timeout is None:
            return float("inf")
        if self.timeout != "auto":
            return float(self.timeout)
        return max(phase.floor_seconds, GAP_MULTIPLE * self._longest_gap)

    def _devices_done(self) -> int:
        """How many of the newest dispatches the devices finished (a flag read each)."""
        done = 0
        for output in list(self._outputs):
            try:
                done += bool(output.is_ready())
            except Exception:  # noqa: BLE001  a deleted or donated output: its work is done
                done += 1
        return done

    def _run(self, stop: threading.Event) -> None:
        seen = (self._beats, self._devices_done(), self._phase)
        since = time.monotonic()
        reported = False
        while not stop.wait(min(LOOK_SECONDS, float(self.limit(self._phase)) / 4)):
            now = time.monotonic()
            current = (self._beats, self._devices_done(), self._phase)
            if current != seen or not self._armed or debugger_attached():
                if self._armed and current[:2] != seen[:2]:
                    self._longest_gap = max(self._longest_gap, now - since)
                seen, since, reported = current, now, False
                continue
            waited = now - since
            if waited >= self.limit(self._phase) and not reported:
                self._fire(waited, time.time() - waited)
                reported = True

    def _fire(self, waited: float, since_wall: float) -> None:
        self.fired = True
        stderr = sys.__stderr__ or sys.stderr
        started = time.strftime("%H:%M:%S", time.localtime(since_wall))
        process = f"process {jax.process_index()}: " if jax.process_count() > 1 else ""
        print(
            f"flaxstate watchdog: {process}no progress for {waited:.0f} s at step {self._step}: "
            f"{self._phase.message}{self._detail} (since {started}).",
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


_RUNNING: WeakSet[Watchdog] = WeakSet()
"""The watchdogs whose thread runs: a loop left unfinished (or kept) at the script's end still has one."""


def _close_all() -> None:
    """At exit, before the interpreter tears down: ends every watchdog's thread (see `Watchdog.close`)."""
    for watchdog in list(_RUNNING):
        watchdog.close()


atexit.register(_close_all)
