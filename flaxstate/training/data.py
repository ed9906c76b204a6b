"""A task's data as a stream whose position can be saved and restored.

Data addressed by the global step (`flaxstate.global_batches`: it has
`iter_from(step)`) starts at the step resumed from, without drawing, on any
process count. An iterator with `get_state()`/`set_state()` (grain's
`DatasetIterator`) is restored exactly from its own state. Any other iterable is re-created with
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

Batches are drawn ahead of use (prefetching, K steps a dispatch), so a
batch drawn is not yet a batch trained: the stream holds every batch drawn
until the loop `commit`s it (its step completed). After an interruption the
loop `rewind`s the stream, and the batches drawn but not trained come again,
in order, before new ones: none is lost or used twice. The position saved
with a record counts committed batches only, and its iterator state is the
one from before the first uncommitted batch.

A Python generator is finished for good once an exception passes through
it. When the data raised and its iterator then ends at once, a re-iterable
is re-created and moved past the batches already drawn (as on resume); a
one-shot iterator cannot be, and that is an error saying so.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax

from flaxstate.run_record import fingerprints

logger = logging.getLogger("flaxstate")


def _has_state(iterator: Any) -> bool:
    return callable(getattr(iterator, "get_state", None)) and callable(getattr(iterator, "set_state", None))


def is_global(data: Any) -> bool:
    """Whether `data` is addressed by the global step (`iter_from(step)`, as `flaxstate.global_batches` is)."""
    return callable(getattr(data, "iter_from", None))


def _nothing() -> None:
    pass


class DataStream:
    """Batches drawn one by one from a task's data, held until trained, with a saveable position."""

    def __init__(
        self, data: Iterable[Any], task_name: str, on_draw: Callable[[], None] | None = None, whole: bool = False
    ) -> None:
        """Wraps `data`; `on_draw` is called after each batch drawn from it (a sign of progress for a watchdog);
        `whole`: its batches go to the loss whole (NNX's `loss_fn(model, batch)`), not split (`batching.normalize`).
        """
        self.whole = whole
        self._data = data
        self._task_name = task_name
        self._on_draw = on_draw or _nothing
        self._iterator: Any = iter(data)  # with get_state/set_state where the data has them (grain's)
        self._one_shot = self._iterator is data
        """An iterator that `iter()` gives back as it is: it cannot be re-created."""
        self._global = is_global(data)
        """Data addressed by the global step: it starts anywhere without drawing, on any process count."""
        self._stateful = _has_state(self._iterator) and not self._global
        self._n_committed = 0
        """Batches trained on (the restored position's included)."""
        self._n_drawn = 0
        """Batches taken from the data since its start: committed, in flight, or to be drawn again."""
        self._in_flight: collections.deque[tuple[Any, Any]] = collections.deque()
        """(the iterator's state before it, or None; batch) of each batch handed out and not committed."""
        self._redraw: collections.deque[tuple[Any, Any]] = collections.deque()
        """Batches handed out before a `rewind`, to hand out again before new ones."""
        self._raised: BaseException | None = None
        """What the data raised at the last draw, if it raised."""
        self._indexed = self._global and callable(getattr(data, "indices", None))
        """Global batches known by their source indices (`fs.global_batches`): fingerprinted by them."""
        self._digest = fingerprints.BatchDigest()
        """The bytes of the first batch committed since the last `take_fingerprint` (data not `_indexed`)."""
        self._fingerprinted = 0
        """The committed batches that `take_fingerprint` has covered."""
        self._n_skipped = 0
        """Batches that rollbacks skipped (counted in `_n_drawn` and `_n_committed`, trained at no step)."""

    def peek(self) -> Any:
        """Returns the first batch without consuming it from the stream."""
        if not self._one_shot:
            return self._first(iter(self._data))
        if self._stateful:
            state = self._iterator.get_state()
            first = self._first(self._iterator)
            self._iterator.set_state(state)
            return first
        first = self._first(self._iterator)
        self._n_drawn += 1
        self._redraw.append((None, first))  # handed out first
        return first

    def _empty(self) -> ValueError:
        return ValueError(f"{self._task_name}.data is empty: it yielded no batch at the first step.")

    def _first(self, iterator: Iterator[Any]) -> Any:
        try:
            return next(iterator)
        except StopIteration:
            raise self._empty() from None

    def next(self) -> Any:
        """Hands out the next batch; it stays in flight until `commit`.

        Raises:
            ValueError: the data is empty, or ran out (naming the batch), or
                a one-shot generator ended after raising.
            Exception: whatever the data raised (the stream stays usable).
        """
        if self._redraw:
            entry = self._redraw.popleft()
        else:
            entry = (self._iterator.get_state() if self._stateful else None, self._draw())
        self._in_flight.append(entry)
        return entry[1]

    def take(self, n_batches: int) -> list[Any]:
        """Hands out the next `n_batches` batches, as `next` does (one call a dispatch of K steps).

        Raises:
            as `next`; the batches drawn before stay in flight.
        """
        if self._redraw or self._stateful:
            return [self.next() for _ in range(n_batches)]
        batches, in_flight = [], self._in_flight
        for _ in range(n_batches):
            batch = self._draw()
            in_flight.append((None, batch))
            batches.append(batch)
        return batches

    def commit(self, n_batches: int, batch: Any = None) -> None:
        """Marks the oldest `n_batches` batches in flight as trained.

        Args:
            batch: their dispatch's host batch, `(inputs, targets)` (K stacked
                for K); the first batch committed since the last
                `take_fingerprint` is digested for the record's fingerprint (but
                global batches', fingerprinted by their indices).
        """
        if n_batches == 1:
            self._in_flight.popleft()
        else:
            for _ in range(n_batches):
                self._in_flight.popleft()
        self._n_committed += n_batches
        if batch is not None and self._n_committed - n_batches == self._fingerprinted and not self._indexed:
            if fingerprints.ENABLED:  # the span's first dispatch: its first batch, where a resume starts
                self._digest.add(fingerprints.first_of(batch, n_batches))

    def take_fingerprint(self) -> tuple[str | None, int | None]:
        """The batches committed since the last call: their global indices' fingerprint (`fs.global_batches`,
        else `None`), and this process's digest of the first one's bytes (0 for global batches, `None` where
        unknown)."""
        first, self._fingerprinted = self._fingerprinted, self._n_committed
        if self._indexed:
            data: Any = self._data
            return fingerprints.of_indices([data.indices(step) for step in range(first, self._n_committed)]), 0
        return None, self._digest.take()

    def rewind(self) -> None:
        """Makes the batches in flight come again, in order, before new ones (after an interruption)."""
        self._redraw.extendleft(reversed(self._in_flight))
        self._in_flight.clear()

    def roll_back(self, position: Mapping[str, Any], n_skip: int) -> int:
        """Moves the stream back to `position` (a `position()` of before) and past `n_skip` batches more (a
        rollback's bad span); returns the batches skipped.

        Data that can go back (global batches, an iterator with a state, a
        re-iterable) skips just those. A one-shot iterator cannot: every
        batch trained since `position` is skipped, and those drawn ahead of
        use come again.
        """
        start = int(position["n_batches"])
        self._digest.take()  # the span's first batch is the one after the skip
        if self._one_shot and not self._stateful:
            self.rewind()
            n_skip = self._n_committed - start
            logger.warning(
                "%s.data is a one-shot iterator, which cannot go back: the rollback skips the %d batches trained "
                "since step %d's record, not only the bad span's. Give a re-iterable (a list, a grain dataset, "
                "flaxstate.global_batches) to skip only those.",
                self._task_name,
                n_skip,
                start,
            )
        else:
            self._in_flight.clear()
            if self._stateful:
                self._redraw.clear()
                self._iterator.set_state(position["iterator_state"])
                self._n_drawn = start
                for _ in range(n_skip):
                    self._draw()
            else:
                self._recreate(start + n_skip)
        self._n_committed = self._fingerprinted = start + n_skip
        self._n_skipped += n_skip
        return n_skip

    def _draw(self) -> Any:
        try:
            batch = next(self._iterator)
        except StopIteration:
            if self._raised is not None:
                return self._recreate_after(self._raised)
            if self._n_drawn == 0:
                raise self._empty() from None
            skipped = f" ({self._n_skipped} of them skipped by rollbacks)" if self._n_skipped else ""
            step, trained = self._n_drawn - self._n_skipped + 1, self._n_committed - self._n_skipped
            ahead = f" (drawn ahead: the loop stands at step {trained})" if trained != step - 1 else ""
            raise ValueError(
                f"{self._task_name}.data ran out after {self._n_drawn} batches{skipped}, at step {step}{ahead}; "
                "repeat it (e.g. grain's .repeat()) or lower n_steps."
            ) from None
        except BaseException as error:  # a KeyboardInterrupt too: a generator it passes through is finished
            self._raised = error
            raise
        self._raised = None
        self._n_drawn += 1
        self._on_draw()
        return batch

    def _recreate_after(self, error: BaseException) -> Any:
        """Re-creates data whose iterator ended right after raising, moved past the batches drawn."""
        self._raised = None
        what = f"{type(error).__name__}({error})" if str(error) else type(error).__name__
        if self._one_shot:
            raise ValueError(
                f"{self._task_name}.data ended right after it raised {what} (at batch {self._n_drawn + 1}): a "
                "Python generator is finished once an exception passes through it. Give data as a re-iterable "
                "(a list, a grain dataset, or an object whose __iter__ starts a new generator) so that it can be "
                "re-created and moved past the batches drawn, or resume from the last checkpoint."
            )
        logger.warning(
            "%s.data ended right after it raised %s: re-created it and moved past the %d batches drawn.",
            self._task_name,
            what,
            self._n_drawn,
        )
        self._recreate(self._n_drawn)
        return self._draw()

    def position(self) -> dict[str, Any]:
        """Returns the position after the committed batches, as JSON."""
        position: dict[str, Any] = {"n_batches": self._n_committed}
        if self._stateful:
            pending = self._in_flight or self._redraw
            position["iterator_state"] = pending[0][0] if pending else self._iterator.get_state()
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
        self._n_skipped = sum(len(entry.get("skipped_steps", ())) for entry in position.get("rollbacks") or ())
        saved_processes = position.get("processes")
        if saved_processes is not None and int(saved_processes) != jax.process_count() and not self._global:
            logger.warning(
                "the checkpoint was trained on %d processes and this run has %d: each process's share of "
                "%s.data changed, so the order of examples is not kept; flaxstate.global_batches keeps it "
                "on any process count.",
                int(saved_processes),
                jax.process_count(),
                self._task_name,
            )
        saved_size = position.get("batch_size")
        if saved_size is not None and int(saved_size) != batch_size:
            return self._move_by_examples(n_batches, int(saved_size), batch_size)
        state = position.get("iterator_state")
        if state is not None and self._stateful:
            self._iterator.set_state(state)
            self._n_committed = self._n_drawn = self._fingerprinted = n_batches
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
        """Re-creates the data (unless it is a one-shot iterator) and moves past `n_batches` batches."""
        if not self._one_shot:
            self._recreate(n_batches)
        else:
            for _ in range(n_batches):
                if self._redraw:  # a one-shot iterator's first batch, taken to peek at it
                    self._redraw.popleft()
                else:
                    self._draw()
        self._n_committed = self._fingerprinted = n_batches

    def _recreate(self, n_batches: int) -> None:
        """Starts the data again with `iter(data)` and draws `n_batches` batches from it (global data: starts there)."""
        self._redraw.clear()
        if self._global:
            self._iterator = self._data.iter_from(n_batches)  # type: ignore[attr-defined]
            self._n_drawn = n_batches
            return
        self._iterator = iter(self._data)
        self._n_drawn = 0
        for _ in range(n_batches):
            self._draw()
