"""A task's data as a stream whose position can be saved and restored.

An iterator with `get_state()`/`set_state()` (grain's `DatasetIterator`) is
restored exactly from its own state. Any other iterable is re-created with
`iter(data)` and advanced past the batches already consumed, which is exact
for deterministic data.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any


def _has_state(iterator: Any) -> bool:
    return callable(getattr(iterator, "get_state", None)) and callable(getattr(iterator, "set_state", None))


class DataStream:
    """Batches drawn one by one from a task's data, with a saveable position."""

    def __init__(self, data: Iterable[Any], task_name: str) -> None:
        self._data = data
        self._task_name = task_name
        self._iterator: Iterator[Any] = iter(data)
        self._n_batches = 0

    def peek(self) -> Any:
        """Returns the first batch without consuming it from the stream."""
        if self._iterator is not self._data:
            return self._first(iter(self._data))
        if _has_state(self._iterator):
            state = self._iterator.get_state()
            first = self._first(self._iterator)
            self._iterator.set_state(state)
            return first
        first = self._first(self._iterator)
        self._iterator = _prepend(first, self._iterator)
        return first

    def _empty(self) -> ValueError:
        return ValueError(f"{self._task_name}.data is empty: it yielded no batch at the first step.")

    def _first(self, iterator: Iterator[Any]) -> Any:
        try:
            return next(iterator)
        except StopIteration:
            raise self._empty() from None

    def next(self) -> Any:
        """Returns the next batch.

        Raises:
            ValueError: the data is empty, or ran out (naming the step).
        """
        try:
            batch = next(self._iterator)
        except StopIteration:
            if self._n_batches == 0:
                raise self._empty() from None
            raise ValueError(
                f"{self._task_name}.data ran out after {self._n_batches} batches, at step {self._n_batches + 1}; "
                "repeat it (e.g. grain's .repeat()) or lower n_steps."
            ) from None
        self._n_batches += 1
        return batch

    def position(self, n_batches: int) -> dict[str, Any]:
        """Returns the position after `n_batches` consumed batches, as JSON."""
        position: dict[str, Any] = {"n_batches": n_batches}
        if _has_state(self._iterator):
            position["iterator_state"] = self._iterator.get_state()
        return position

    def restore(self, position: Mapping[str, Any] | None, n_batches: int) -> None:
        """Moves the stream to a saved position (or past `n_batches` batches without one)."""
        state = (position or {}).get("iterator_state")
        if state is not None and _has_state(self._iterator):
            self._iterator.set_state(state)
            self._n_batches = n_batches
            return
        n_batches = int((position or {}).get("n_batches", n_batches))
        if self._iterator is not self._data:
            self._iterator = iter(self._data)
        self._n_batches = 0
        for _ in range(n_batches):
            self.next()


def _prepend(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest
