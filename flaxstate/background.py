"""Saves left running in the background, and the places that wait for them.

A writer's save runs in the background while training goes on. Four places
wait for it: the writer itself (`wait()`, `close()`, `with writer:`, and any
final record), `TrainLoop` when it ends or is left early, and, for anything
still running when the interpreter exits, an `atexit` hook. Python runs
`atexit` hooks only after it stops taking new `concurrent.futures` work,
which orbax needs to finish a save, so a save still running at that point is
lost. The hook then names it and ends the process with status 1, never 0:
a script must not look successful when its last checkpoint is not on disk.
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from typing import Protocol


class Pending(Protocol):
    """Something that may have a save running.

    `wait()` blocks until it is done and raises its failure; `settle()` blocks
    until it is done and keeps its failure for the next `wait()`.
    """

    def wait(self) -> None: ...

    def settle(self) -> None: ...


_PENDING: weakref.WeakSet[Pending] = weakref.WeakSet()


def track(owner: Pending) -> None:
    """Makes `wait_all()` and the exit hook wait for `owner`'s saves."""
    _PENDING.add(owner)


def untrack(owner: Pending) -> None:
    """Stops waiting for `owner` (it was closed)."""
    _PENDING.discard(owner)


def wait_all() -> None:
    """Waits for every tracked save.

    Raises:
        Exception: the first failure, after every save was waited for.
    """
    first: Exception | None = None
    for owner in list(_PENDING):
        try:
            owner.wait()
        except Exception as error:  # noqa: BLE001 - every save is waited for before the first failure is raised
            first = first or error
    if first is not None:
        raise first


def settle_all() -> None:
    """Waits for every tracked save without raising: failures stay for the writers' next `wait()` (or exit)."""
    for owner in list(_PENDING):
        owner.settle()


def _at_exit() -> None:
    failed = False
    for owner in list(_PENDING):
        try:
            owner.wait()
        except Exception as error:  # noqa: BLE001 - reported, then the exit status says so
            failed = True
            hint = ""
            if "shutdown" in str(error):
                hint = (
                    "\nIt was still running when the script ended. Wait for it before the end: "
                    "writer.wait(), writer.close(), or `with CheckpointFileWriter(...) as writer:`."
                )
            print(f"flaxstate: {error}{hint}", file=sys.stderr)
    if failed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # an atexit hook cannot otherwise change the exit status


atexit.register(_at_exit)
