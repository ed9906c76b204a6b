"""A run's train and eval curves, from its TensorBoard event files: `fs.plot(run_dir)`.

The figure is a `matplotlib.figure.Figure` made without pyplot, so a notebook
shows it inline as a cell's value and a cell run again leaves no figure
registered behind; `flaxstate plot DIR -o FILE.png` writes the same figure.
"""

from __future__ import annotations

import functools
import io
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flaxstate import extras
from flaxstate.locations import run_directory

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def read_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Returns `{tag: [(step, value), ...]}` from a run's TensorBoard event files.

    Raises:
        ImportError: tensorboard is missing (its reader parses the files).
        FileNotFoundError: `run_dir` is not a directory, or holds no event files.
        ValueError: a URL of a scheme flaxstate does not read, or a bucket that cannot be reached.
    """
    run_dir = run_directory(run_dir, "flaxstate.plot")
    accumulator = extras.require("tensorboard.backend.event_processing.event_accumulator", "plot", "flaxstate.plot")
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} does not exist or is not a directory: give a run's directory.")
    if not list(run_dir.glob("events.out.tfevents.*")):
        raise FileNotFoundError(f"{run_dir} holds no TensorBoard event files; write them with flaxstate.SummaryWriter.")
    events = accumulator.EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def plot(run_dir: str | Path) -> Figure:
    """Returns a figure of a run's metric curves: one panel a metric, a line a group (`train`, `eval`, ...).

    Example (in a notebook, the cell's value shows inline):
        fs.plot("runs/digits")

    Args:
        run_dir: the directory (or `gs://`, `s3://` bucket path) that `SummaryWriter` wrote the run's
            event files to.

    Returns:
        a `matplotlib.figure.Figure`; `figure.savefig(path)` writes it.

    Raises:
        ImportError: matplotlib or tensorboard is missing (`pip install 'flaxstate[plot]'`).
        FileNotFoundError: `run_dir` is not a directory, or holds no event files.
        ValueError: a URL of a scheme flaxstate does not read, or a bucket that cannot be reached.
    """
    return curves(read_scalars(run_dir), f"flaxstate run {run_dir}")


def curves(scalars: dict[str, list[tuple[int, float]]], title: str) -> Figure:
    """The figure of `read_scalars`'s curves, titled `title` (`plot`'s, and `flaxstate plot`'s)."""
    by_metric: dict[str, dict[str, list[tuple[int, float]]]] = defaultdict(dict)
    for tag, points in scalars.items():
        group, _, name = tag.partition("/")
        by_metric[name or group][group] = points
    names = sorted(by_metric)
    figure = _figure_class()(figsize=(7, 2.6 * max(1, len(names))))
    axes = figure.subplots(max(1, len(names)), 1, squeeze=False)
    for axis, name in zip(axes[:, 0], names, strict=False):
        for group, points in sorted(by_metric[name].items()):
            steps, values = zip(*sorted(points), strict=True)
            axis.plot(steps, values, marker="o", markersize=3, label=group)
        axis.set_title(name)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    return figure


@functools.cache
def _figure_class() -> Any:
    """A `Figure` that shows as its PNG in a notebook: made without pyplot, no backend would display it."""
    base: Any = extras.require("matplotlib.figure", "plot", "flaxstate.plot").Figure

    class Curves(base):
        """A run's curves (`plot`)."""

        def _repr_png_(self) -> bytes:
            buffer = io.BytesIO()
            self.savefig(buffer, format="png", dpi=100)
            return buffer.getvalue()

    return Curves
