"""What a loop shows on stdout: the model's size at start, then live progress."""

from __future__ import annotations

import collections
import datetime
import importlib.util
import sys
from typing import Any

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from flaxstate.records import Checkpoint, bound_note

SPEED_WINDOW = 5
"""The bar's speed is the steps the devices completed over the last this many records' training time."""


def count_parameters(params: Any) -> tuple[int, int]:
    """Returns the number of parameters and their bytes."""
    leaves = jax.tree.leaves(params)
    return sum(int(leaf.size) for leaf in leaves), sum(int(leaf.size) * leaf.dtype.itemsize for leaf in leaves)


def _console() -> Console:
    """rich's console on stdout; in a notebook without ipywidgets (rich's live display there), plain text.

    rich would warn at every training cell ('install "ipywidgets" for Jupyter support'); the `notebook`
    extra installs it.
    """
    console = Console(file=sys.stdout)
    if console.is_jupyter and importlib.util.find_spec("ipywidgets") is None:
        console = Console(file=sys.stdout, force_jupyter=False)
    return console


class ProgressDisplay:
    """A live progress bar (step, steps/s, MFU where known, last loss, ETA) that stays silent when disabled.

    The step count moves at each dispatch; the speed and the ETA are the
    records' (steps the devices completed over the last `SPEED_WINDOW`
    records' training time, compilation left out), so the bar and the
    records say one speed. Only the primary process of a multi-process run
    shows anything.
    """

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled and jax.process_index() == 0
        self._progress: Progress | None = None
        self._task: Any = None
        self._console = _console()
        self._window: collections.deque[tuple[int, float]] = collections.deque(maxlen=SPEED_WINDOW)

    def log(self, message: str) -> None:
        """Prints one line."""
        if self._enabled:
            self._console.print(message, highlight=False, soft_wrap=True)

    def start(self, step: int, total: int) -> None:
        """Shows the bar at `step` of `total` (again, after a record, with a new total)."""
        if not self._enabled:
            return
        if self._progress is None:
            self._progress = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn(
                    "{task.fields[speed_text]} steps/s{task.fields[mfu]}  loss {task.fields[loss]}  {task.fields[eta]}"
                ),
                TextColumn("{task.fields[bound]}"),
                console=self._console,
                transient=False,
            )
            self._task = self._progress.add_task(
                "train", total=total, completed=step, loss="-", speed_text="-", mfu="", eta="", bound=""
            )
            self._progress.start()
        else:
            self._progress.update(self._task, total=total)

    def advance(self, n_steps: int) -> None:
        """Counts steps dispatched."""
        if self._progress is not None:
            self._progress.advance(self._task, n_steps)

    @property
    def speed(self) -> float:
        """The speed the bar shows: steps a second over the last records' training time (0 before any)."""
        seconds = sum(seconds for _, seconds in self._window)
        return sum(n_steps for n_steps, _ in self._window) / seconds if seconds > 0 else 0.0

    def record(self, record: Checkpoint) -> None:
        """Shows the newest record's loss, the speed so far, and whether the devices waited most of the time.

        Above one half of the record's time, the bar says the run is
        input-bound (waiting for data) or host-bound (waiting for the host).
        """
        self._window.append((record.n_completed_steps, record.training_time))
        if self._progress is not None:
            speed = self.speed
            task = self._progress.tasks[0]
            left = (task.total or 0) - int(record.step)
            eta = f"ETA {datetime.timedelta(seconds=round(left / speed))}" if speed and left > 0 else ""
            bound = bound_note(record.data_fraction, record.idle_fraction)
            mfu = f"  MFU {record.mfu:.1%}" if record.mfu is not None else ""
            self._progress.update(
                self._task,
                loss=f"{record.loss:.4g}",
                speed_text=f"{speed:.1f}" if speed else "-",
                mfu=mfu,
                eta=eta,
                bound=f"  {bound}" if bound else "",
            )

    def close(self) -> None:
        """Stops the live display."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
