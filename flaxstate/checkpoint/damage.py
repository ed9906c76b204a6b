"""What counts as a damaged checkpoint, an interrupted read, and the noise orbax makes about either.

A reader falls back past a damaged checkpoint (missing or truncated files,
metadata that does not validate) and never past anything else: out of
memory, a template of the wrong type, a bug or a Ctrl-C must not make a run
silently go back in time. orbax turns any exception inside an array read
into a plain `Exception` with the original only in its cause chain, so both
questions are answered by walking the chain.

When one read of a step fails, orbax's restore stops and its other reads
still finish on tensorstore's threads: asyncio reports each as "Task
exception was never retrieved", and each completion into orbax's closed
event loop as `RuntimeError: Event loop is closed` (and a read that a Ctrl-C
stopped as its coroutine's exception, and an event loop whose construction
or close it stopped halfway as an `AttributeError` or a `ValueError` from
the loop's `__del__`, which closes it again) through `sys.unraisablehook`.
A failed save logs every failed array write at ERROR with a traceback
through absl (about 330 lines for a small state).
`quiet_orbax()` keeps one line of ours for each, and orbax's own reports in
the log at DEBUG; it is installed by the first `CheckpointStore`, not at import.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from flaxstate import tree_paths
from flaxstate.checkpoint.errors import CheckpointError
from flaxstate.locations import tree_size


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose files are missing, truncated, or hold metadata that does not validate."""


_STATUS = re.compile(r"\b(NOT_FOUND|DATA_LOSS|OUT_OF_RANGE|FAILED_PRECONDITION|INVALID_ARGUMENT|UNKNOWN): ")
"""The tensorstore status codes of a read that met missing or damaged files (never RESOURCE_EXHAUSTED)."""


def _chain(error: BaseException) -> list[BaseException]:
    """The exception and its causes and contexts, each once."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def interrupted(error: BaseException) -> bool:
    """Whether a Ctrl-C (`KeyboardInterrupt`) is anywhere in the exception's chain."""
    return any(isinstance(link, KeyboardInterrupt) for link in _chain(error))


def is_damage(error: BaseException) -> bool:
    """Whether a read failed on missing or damaged files, rather than for any other reason.

    Missing files and folders (`OSError`), undecodable JSON, metadata that
    does not validate (`DamagedCheckpointError`), and tensorstore's read
    errors (a `ValueError` with a status such as `NOT_FOUND` or `DATA_LOSS`),
    anywhere in the exception's chain. A chain with a `KeyboardInterrupt` in
    it is never damage, nor is out of memory, a template of the wrong type or
    a bug: a reader must not silently go back in time for those.
    """
    chain = _chain(error)
    if any(isinstance(link, KeyboardInterrupt) for link in chain):
        return False
    for link in chain:
        if isinstance(link, OSError | json.JSONDecodeError | DamagedCheckpointError):
            return True
        if isinstance(link, ValueError) and _STATUS.search(str(link)) and "RESOURCE_EXHAUSTED" not in str(link):
            return True
    return False


def summary(error: BaseException) -> str:
    """One line that names what was damaged: the first line of the error, without tensorstore's spec."""
    line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"\s*\[?(source locations|tensorstore_spec)[=:].*$", "", line)[:300]


def reraise_interrupt(error: BaseException) -> None:
    """Raises `KeyboardInterrupt` (from `error`) if a Ctrl-C is in its chain; else returns."""
    if interrupted(error) and not isinstance(error, KeyboardInterrupt):
        raise KeyboardInterrupt("interrupted while reading or writing a checkpoint") from error


class _LateReadReports(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" of a read that a damage or a Ctrl-C stopped."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or "never retrieved" not in record.getMessage():
            return True
        return not (is_damage(error) or interrupted(error) or "Encountered error while reading" in str(error))


class _OrbaxErrorsToDebug(logging.Filter):
    """Lowers orbax's per-array ERROR reports of a failed save (and their tracebacks) to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and "raised an exception" in record.getMessage():
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def _late_completion_hook(previous: Any) -> Any:
    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        late = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
        # An event loop of orbax's whose construction or close a Ctrl-C stopped halfway: its __del__
        # closes it again and finds no self-pipe (AttributeError) or a closed one (ValueError: fd -1).
        late = late or (
            isinstance(error, AttributeError | ValueError)
            and getattr(unraisable.object, "__qualname__", "") == "BaseEventLoop.__del__"
        )
        # A read abandoned by a stopped restore: its coroutine closed (GeneratorExit), interrupted or damaged.
        abandoned = error is not None and any(
            isinstance(link, GeneratorExit | KeyboardInterrupt) for link in _chain(error)
        )
        if not (late or abandoned or (error is not None and is_damage(error))):
            previous(unraisable)

    hook.flaxstate_quiet_orbax = True  # type: ignore[attr-defined]
    return hook


_installed = False


def quiet_orbax() -> None:
    """Keeps orbax's reports of a failed read or save to the line flaxstate gives (installed once)."""
    global _installed
    if _installed:
        return
    _installed = True
    logging.getLogger("asyncio").addFilter(_LateReadReports())
    logging.getLogger("absl").addFilter(_OrbaxErrorsToDebug())
    if not getattr(sys.unraisablehook, "flaxstate_quiet_orbax", False):
        sys.unraisablehook = _late_completion_hook(sys.unraisablehook)


def check_claimed_sizes(step_dir: Path, stored_flat: Mapping[str, Any]) -> None:
    """Checks that the arrays a step claims fit in its files, before a read with no template allocates them.

    orbax stores arrays uncompressed (values equal to the fill value too),
    so the step's files hold at least the bytes of its arrays; a shape
    claimed beyond that is damaged metadata, and allocating it could end
    the process (`std::bad_alloc`).

    Raises:
        DamagedCheckpointError: naming the largest array, its claimed shape and the bound.
    """
    sizes = {}
    for path, leaf in stored_flat.items():
        shape, dtype = tree_paths.shape_and_dtype(leaf)
        if any(not isinstance(dim, int) or dim < 0 for dim in shape):
            raise DamagedCheckpointError(f"{step_dir}: {path} claims an invalid shape {shape}.")
        sizes[path] = (math.prod(shape) * np.dtype(dtype).itemsize, shape)
    claimed = sum(size for size, _ in sizes.values())
    on_disk = tree_size(step_dir)
    if claimed > on_disk:
        path, (size, shape) = max(sizes.items(), key=lambda item: item[1][0])
        raise DamagedCheckpointError(
            f"{step_dir}: {path} claims shape {list(shape)} ({size:,} bytes), and its arrays "
            f"{claimed:,} bytes in all, but the step's files hold {on_disk:,} bytes (orbax stores arrays "
            "uncompressed): its array metadata is damaged. Nothing was allocated."
        )
