"""Checks of the settings that users pass, often read from a config file: each error names the setting, the value
found (with its type) and what the setting takes, before any work is done.

A YAML or JSON config gives strings where a number was meant (`keep: "3"`),
and YAML 1.1 reads `1e3` as a string: the writers, readers and loops refuse
them here with one line instead of a `TypeError` deep inside a comparison.

Example:
    >>> count("CheckpointFileWriter", "keep", "3")
    Traceback (most recent call last):
    ...
    ValueError: CheckpointFileWriter keep must be a positive int, got '3' (a str).
"""

from __future__ import annotations

import math
import numbers
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np


def _refuse(owner: str, name: str, value: Any, takes: str) -> ValueError:
    return ValueError(f"{owner} {name} must be {takes}, got {value!r} (a {type(value).__name__}).")


def is_integer(value: Any) -> bool:
    """Whether `value` is an integer that a config gives: a Python int, or numpy's (`numbers.Integral`), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def is_real(value: Any) -> bool:
    """Whether `value` is a real number that a config gives: a Python or numpy int or float (`numbers.Real`), not a
    bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def count(owner: str, name: str, value: Any, minimum: int = 1) -> int:
    """`value` as a Python int of at least `minimum` (numpy's integers taken; a bool or a string is refused)."""
    if not is_integer(value) or value < minimum:
        raise _refuse(owner, name, value, "a positive int" if minimum == 1 else f"an int of at least {minimum}")
    return int(value)


def optional_count(owner: str, name: str, value: Any, minimum: int = 0) -> int | None:
    """`None`, or `value` as an int of at least `minimum`."""
    return None if value is None else count(owner, name, value, minimum)


def optional_seconds(owner: str, name: str, value: Any) -> float | None:
    """`None`, or `value` as a positive finite number of seconds."""
    if value is None:
        return None
    if not is_real(value) or not math.isfinite(value) or value <= 0:
        raise _refuse(owner, name, value, "a positive number of seconds or None")
    return float(value)


def flag(owner: str, name: str, value: Any) -> bool:
    """`value`, which must be a bool (a string such as "false" is refused: it would read as true)."""
    if not isinstance(value, bool | np.bool_):
        raise _refuse(owner, name, value, "True or False")
    return bool(value)


def plain(value: Any) -> Any:
    """`json.dumps`'s `default=`: a numpy scalar as the Python number it holds (what a config built with numpy
    gives: `np.int64(2)`, `np.float32(0.9)`), so that what is stored as JSON is a plain number.

    Raises:
        TypeError: anything else, as `json.dumps` raises it.
    """
    if isinstance(value, np.generic) and np.ndim(value) == 0 and not isinstance(value, np.void):
        return value.item()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def text(owner: str, name: str, value: Any) -> str:
    """`value`, which must be a non-empty string."""
    if not isinstance(value, str) or not value:
        raise _refuse(owner, name, value, "a non-empty string")
    return value


def optional_callable(owner: str, name: str, value: Any) -> Callable[..., Any] | None:
    """`None`, or `value`, which must be callable."""
    if value is not None and not callable(value):
        raise _refuse(owner, name, value, "a function, or None")
    return value


_PACKAGE = str(Path(__file__).parent)
_WARNED: set[tuple[str, str]] = set()
"""The deprecated keywords already warned of in this process, by door and keyword."""


def deprecated(owner: str, old: str, new: str) -> None:
    """Warns once a process that `owner`'s keyword `old` is deprecated (a `DeprecationWarning` pointing at the
    caller's line outside flaxstate, naming `new`, the object that replaces it); the keyword still works in this
    release."""
    if (owner, old) in _WARNED:
        return
    _WARNED.add((owner, old))
    level = 2
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    warnings.warn(
        f"{owner}'s {old} {'are' if ', ' in old else 'is'} deprecated and will be removed in a later release: give "
        f"{new} instead.",
        DeprecationWarning,
        stacklevel=level,
    )
