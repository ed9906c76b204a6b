"""A task's data as a stream whose position can be saved and restored.

An iterator with `get_state()`/`set_state()` (grain's `DatasetIterator`) is
restored exactly from its own state. Any other iterable is re-created with
`iter(data)` and advanced past the batches already consumed, which is exact
for deterministic data.

A position counts batches, so it is saved with the global batch size. A run
resumed with another batch size is moved to the same *example*: the data is
re-created and advanced by `examples consumed / new batch size` batches
(exact when the data yields the same examples in the same order whatever its
batch size, as a pipeline that batches last does). Where that cannot be done
(the examples do not divide into the new batch size, or the data is a
one-shot iterator that cannot be re-created), the resume is refused with an
error naming both sizes, rather than silently skipping or repeating examples.
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
        self._one_shot = self._iterator is data
        """An iterator that `iter()` gives back as it is: it cannot be re-created."""
        self._n_batches = 0

    def peek(self) -> Any:
        """Returns the first batch without consuming it from the stream."""
        if not self._one_shot:
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

    @property
    def n_batches(self) -> int:
        """How many batches were drawn so far (the restored position's included)."""
        return self._n_batches

    def position(self, n_batches: int) -> dict[str, Any]:
        """Returns the position after `n_batches` consumed batches, as JSON."""
        position: dict[str, Any] = {"n_batches": n_batches}
        if _has_state(self._iterator):
            position["iterator_state"] = self._iterator.get_state()
        return position

    def restore(self, position: Mapping[str, Any] | None, n_batches: int, batch_size: int) -> str | None:
        """Moves the stream to a saved position (or past `n_batches` batches without one).

        Args:
            position: the saved position: `n_batches`, the global `batch_size`
                it counts in (absent before format 3), and an iterator state.
            n_batches: batches consumed when the position has no count.
            batch_size: this run's global batch size.

        Returns:
            a line to log when the data was moved by examples (the batch size
            changed), else `None`.

        Raises:
            ValueError: the batch size changed and the data cannot be moved to
                the same example, naming both sizes and the way out.
        """
        position = position or {}
        n_batches = int(position.get("n_batches", n_batches))
        saved_size = position.get("batch_size")
        if saved_size is not None and int(saved_size) != batch_size:
            return self._move_by_examples(n_batches, int(saved_size), batch_size)
        state = position.get("iterator_state")
        if state is not None and _has_state(self._iterator):
            self._iterator.set_state(state)
            self._n_batches = n_batches
            return None
        self._advance(n_batches)
        return None

    def _move_by_examples(self, n_batches: int, saved_size: int, batch_size: int) -> str:
        examples = n_batches * saved_size
        if self._one_shot:
            raise ValueError(
                f"the checkpoint was trained with a global batch size of {saved_size} and this run's is "
                f"{batch_size}; {self._task_name}.data is a one-shot iterator, so it cannot be moved to example "
                f"{examples} of a re-created stream. Resume with batch size {saved_size}, or give a re-iterable "
                "(a list, a grain dataset) that yields the same examples in the same order."
            )
        if examples % batch_size:
            raise ValueError(
                f"the checkpoint was trained with a global batch size of {saved_size} and this run's is "
                f"{batch_size}: its {examples} examples ({n_batches} batches) do not divide into batches of "
                f"{batch_size}, so training would skip or repeat examples. Resume with batch size {saved_size}, "
                f"or one that divides {examples}."
            )
        self._advance(examples // batch_size)
        return (
            f"The batch size changed from {saved_size} to {batch_size}: the data was moved to example {examples} "
            f"(batch {examples // batch_size} of {batch_size})."
        )

    def _advance(self, n_batches: int) -> None:
        """Re-creates the data (unless it is a one-shot iterator) and draws `n_batches` batches from it."""
        if not self._one_shot:
            self._iterator = iter(self._data)
        self._n_batches = 0
        for _ in range(n_batches):
            self.next()


def _prepend(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest
