"""One line to the person who runs the script: what the loop's display shows of what the writers say.

A writer says once where its checkpoints go; the newest `TrainLoop` that
prints (`stdout=True`, the primary process) prints it, as it prints where
it resumed from. Held weakly: a loop that is gone takes the display with it,
and nothing is printed where no loop prints.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

_listener: weakref.WeakMethod[Callable[[str], None]] | None = None


def listen(log: Callable[[str], None]) -> None:
    """Makes `log` (a display's bound method) print what `say` is given, in place of the one before."""
    global _listener
    _listener = weakref.WeakMethod(log)


def say(line: str) -> None:
    """Prints `line` through the display that listens, if any."""
    log = _listener() if _listener is not None else None
    if log is not None:
        log(line)
