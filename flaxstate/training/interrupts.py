"""Ctrl-C and preemption notices, turned into flags that the loop acts on between dispatches.

A signal handler runs between two bytecodes of the main thread, wherever it
is: inside the user's data generator (which a `KeyboardInterrupt` passing
through finishes for good), or after a dispatch donated the old state and
before the new one is stored (which loses the state). So while `TrainLoop`
trains, its own SIGINT handler only notes the signal, and the loop hands it
to the handler it replaced (Python's raises `KeyboardInterrupt`) at the next
dispatch boundary, with the state stored and the batches drawn kept. A
second SIGINT that comes while the loop waits inside the data (a reader
that hangs) is handed over at once; no batch is lost by it either (the data
stream re-creates a generator that it finishes).

SIGUSR1 asks for a checkpoint: the next record is `requested` (on every
process, whichever was signalled), and writers save it; training goes on.
Its handler is installed and put back as SIGTERM's is, over the default
action only.

SIGTERM, the preemption notice of cloud schedulers, sets a flag that stays
set: the loop stops at the next dispatch boundary and yields one last record
with `preempted=True`. A notice that comes when the loop has nothing left to
train (after its final record) is sent again once its handler is put back,
so it does what it did before (the default ends the process). Under several processes JAX's coordination service
(started by `jax.distributed.initialize`) catches SIGTERM itself; the loop
asks it once a dispatch (`reached_preemption_sync_point`, a call that costs
microseconds until a notice comes), and every process stops at the same
step.

Python runs signal handlers in the main thread only, and only a handler set
from Python can be put back, so the loop installs its handlers from the main
thread only, over Python's default SIGINT handler or a callable of the user's
(SIGINT) and over the default action (SIGTERM). A handler that is `SIG_IGN`,
a SIGTERM handler of the user's own, and handlers set outside Python stay as
they are. Driven from another thread, the loop installs nothing: Ctrl-C
raises in the main thread as always, and SIGTERM does what it did before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import jax
from jax.experimental import multihost_utils

Handler = Callable[[int, FrameType | None], Any] | int | None


def _is_own_frame(frame: FrameType | None) -> bool:
    """Whether the signal landed in flaxstate's own code (which reaches a boundary without blocking)."""
    return frame is not None and str(frame.f_globals.get("__name__", "")).startswith("flaxstate.")


class Signals:
    """SIGINT, SIGTERM and SIGUSR1 as flags read between dispatches, and the handlers that set them.

    Args:
        handle_preemption: act on SIGTERM (a preemption notice), or leave it alone.
    """

    def __init__(self, handle_preemption: bool) -> None:
        self._handle_preemption = handle_preemption
        self._sync_point = handle_preemption and (jax.process_count() > 1 or signal.getsignal(signal.SIGTERM) is None)
        """Whether notices come through JAX's coordination service (it caught SIGTERM)."""
        self._n_checks = 0
        self._holders: dict[int, int] = {}
        self._previous: dict[int, Handler] = {}
        self.interrupted = False
        """A SIGINT came and was not yet handed over."""
        self.preempted = False
        """A preemption notice came (it stays set)."""
        self._preemption_taken = False
        self.in_data = False
        """The loop is drawing a batch from the data."""
        self.requested = False
        """A checkpoint was asked for (SIGUSR1) since the last record."""

    def _wanted(self, interrupts: bool) -> list[signal.Signals]:
        wanted = [signal.SIGINT] if interrupts else []
        if self._handle_preemption and not self._sync_point:
            wanted.append(signal.SIGTERM)
        if hasattr(signal, "SIGUSR1"):
            wanted.append(signal.SIGUSR1)
        return wanted

    @staticmethod
    def _takes_over(signum: int, previous: Handler) -> bool:
        if signum == signal.SIGINT:
            return callable(previous)
        return previous == signal.SIG_DFL  # SIGTERM, SIGUSR1: never over a handler of the user's

    @contextlib.contextmanager
    def installed(self, interrupts: bool) -> Iterator[None]:
        """Installs the loop's handlers for the block (nested blocks share them); restores the previous ones.

        Args:
            interrupts: catch SIGINT too (while training; not while the user's
                code runs between records).

        On a normal exit of the outermost block that holds SIGINT, a SIGINT
        noted meanwhile is handed to the handler it replaced (Python's raises
        `KeyboardInterrupt`); after an exception it is dropped (the exception
        already stopped the call).
        """
        held: list[int] = []
        if threading.current_thread() is threading.main_thread():
            for signum in self._wanted(interrupts):
                if not self._holders.get(signum):
                    previous = signal.getsignal(signum)
                    if previous == self._handle:  # left installed by a release off the main thread
                        previous = self._previous[signum]
                    if not self._takes_over(signum, previous):
                        continue
                    self._previous[signum] = previous
                    signal.signal(signum, self._handle)
                self._holders[signum] = self._holders.get(signum, 0) + 1
                held.append(signum)
        handler = self._previous.get(signal.SIGINT)
        try:
            yield
        except BaseException:
            self.interrupted = False
            self._release(held)
            raise
        if signal.SIGINT in self._release(held):
            self._hand_over(handler)

    def _release(self, held: list[int]) -> list[int]:
        """Drops this block's hold on its signals; returns those it was the last to hold (restored)."""
        released = []
        for signum in held:
            self._holders[signum] -= 1
            if self._holders[signum] == 0:
                released.append(signum)
                if threading.current_thread() is threading.main_thread():
                    signal.signal(signum, self._previous.pop(signum))
                    if signum == signal.SIGTERM and self.preempted and not self._preemption_taken:
                        os.kill(os.getpid(), signum)  # the loop ended before it could act: as if never caught
        return released

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._holders.get(signum):  # left installed (released from another thread): act as before
            previous = self._previous.pop(signum, signal.SIG_DFL)
            signal.signal(signum, previous)
            os.kill(os.getpid(), signum)
            return
        if signum == signal.SIGTERM:
            self.preempted = True
        elif signum == getattr(signal, "SIGUSR1", None):
            self.requested = True
        elif self.interrupted and self.in_data and not _is_own_frame(frame):
            self._hand_over(self._previous.get(signal.SIGINT), frame)  # a second Ctrl-C in a data reader
        else:
            self.interrupted = True

    def _hand_over(self, handler: Handler, frame: FrameType | None = None) -> None:
        """Gives a noted SIGINT to the handler it was taken from."""
        if self.interrupted:
            self.interrupted = False
            if callable(handler):
                handler(signal.SIGINT, frame)

    def interrupt_now(self) -> None:
        """At a dispatch boundary: hands a noted SIGINT over (raising `KeyboardInterrupt` by default)."""
        self._hand_over(self._previous.get(signal.SIGINT))

    def noticed_here(self) -> bool:
        """Whether this process's own handler has seen a preemption notice (one process; `False` otherwise).

        Under several processes a notice reaches one process first: work that all
        must do alike (an evaluation's collectives) cannot stop on it alone.
        """
        return self.preempted and not self._sync_point and jax.process_count() == 1

    @property
    def preemption_taken(self) -> bool:
        """Whether the loop made its preempted record (it has ended)."""
        return self._preemption_taken

    def take_preemption(self) -> bool:
        """When the loop makes its record: whether it is the preempted one (the notice is then acted on)."""
        self._preemption_taken = self.preempted
        return self.preempted

    def take_request(self) -> bool:
        """When the loop makes its record: whether a checkpoint was asked for since the previous one (then cleared)."""
        requested, self.requested = self.requested, False
        return requested

    def reached_preemption(self) -> bool:
        """At a dispatch boundary: whether a preemption notice stops the loop here (on every process)."""
        if self._sync_point and not self.preempted:
            self._n_checks += 1
            self.preempted = multihost_utils.reached_preemption_sync_point(self._n_checks)
        return self.preempted
