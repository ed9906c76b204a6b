"""The two ways a save runs in the background, and the priority it runs at.

In one process the whole orbax save, from the device-to-host copy (of arrays
on the devices; TrainLoop's records are already on the host) to the rename of
orbax's temporary directory, runs in one thread of ours (`BackgroundSave`),
below the loop's CPU priority, so the caller waits for none of it. Under
several processes orbax's own asynchronous save is used (`OrbaxAsyncSave`),
whose synchronous part (the device-to-host copy and the cross-process
barriers) runs in the caller: a barrier or a collective in a second thread
could pair up with a different one on another process. Either is waited for
with `join`, which a Ctrl-C interrupts without forgetting the save.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Self

import orbax.checkpoint as ocp

from flaxstate import background, locations
from flaxstate.checkpoint import damage
from flaxstate.checkpoint.errors import CheckpointError, CheckpointSaveError
from flaxstate.checkpoint.steps import VANISHING_SECONDS


class OrbaxAsyncSave:
    """A save that orbax finishes in its own background thread."""

    def __init__(self, step: int, manager: ocp.CheckpointManager) -> None:
        self.step = step
        self._manager = manager
        self._error: BaseException | None = None
        self._done = False
        self._started = time.perf_counter()
        self.seconds: float | None = None
        """From the start to the end of the save, once joined (the end as the join saw it)."""

    @property
    def finished(self) -> bool:
        """Whether the save ended (asked without waiting)."""
        return self._done or not self._manager.is_saving_in_progress()

    @property
    def succeeded(self) -> bool:
        """Whether it was joined and did not fail."""
        return self._done and self._error is None

    def join(self) -> None:
        if not self._done:
            try:
                self._manager.wait_until_finished()
            except Exception as error:  # noqa: BLE001 - kept, so that join() raises it every time
                damage.reraise_interrupt(error)  # a Ctrl-C while waiting: the save is still pending
                self._error = error
            self._done = True
            self.seconds = time.perf_counter() - self._started
        if self._error is not None:
            raise self._error


SAVE_NICENESS = 10
"""How much lower a background save's thread runs than training on Linux (its `nice` increment): on a busy
host the loop's dispatch and data come first, and a save takes what is left (benchmarks/input.py: the digits
example's steps/s about doubled on 2 CPU cores, its total time unchanged)."""


def lower_priority() -> None:
    """Lowers the calling thread's CPU priority (Linux, where `nice` is per thread; elsewhere nothing)."""
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SAVE_NICENESS)
        except OSError:  # a sandbox that forbids it: the save runs at the loop's priority
            pass


class BackgroundSave:
    """One save running in its own (non-daemon) thread, below the loop's priority; `join` re-raises its error.

    `join` waits on a plain lock that the save's thread releases as it ends,
    not on `Thread.join` nor on a `threading.Event`. In CPython 3.11 a Ctrl-C
    inside `Thread.join` can mark a running thread as stopped, after which
    every later join returns at once and the save would be forgotten. An
    Event's wait re-acquires its condition's lock after it is woken; a Ctrl-C
    that comes while the saving thread holds that lock (setting the event, as
    the save ends) interrupts the re-acquire, and the wait's `with` then fails
    with `RuntimeError: release unlocked lock` instead of the KeyboardInterrupt
    (seen in a notebook's Stop during `writer.wait()`). An interrupted
    `Lock.acquire` holds nothing; whether the save ended is a flag that the
    thread sets before it releases the lock.
    """

    def __init__(self, step: int, save: Callable[[], Any]) -> None:
        self.step = step
        self._error: BaseException | None = None
        self._finished = False
        self._ended = threading.Lock()
        self._ended.acquire()  # released by the save's thread as it ends
        self._started = time.perf_counter()
        self.seconds: float | None = None
        """From the start to the end of the save, once it ended."""
        self._thread = threading.Thread(target=self._run, args=(save,), name=f"flaxstate-save-{step}")
        self._thread.start()

    def _run(self, save: Callable[[], Any]) -> None:
        lower_priority()
        try:
            save()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread by join()
            self._error = error
        finally:
            self.seconds = time.perf_counter() - self._started
            self._finished = True
            self._ended.release()

    @property
    def finished(self) -> bool:
        """Whether the save ended (asked without waiting)."""
        return self._finished

    @property
    def succeeded(self) -> bool:
        """Whether it ended without failing."""
        return self._finished and self._error is None

    def join(self) -> None:
        while not self._finished:  # a Ctrl-C here leaves the save running and this object pending
            if self._ended.acquire(timeout=1.0):  # a Ctrl-C between these two calls leaves it held: the flag decides
                self._ended.release()
        if self._error is not None:
            raise self._error


Tree = Mapping[str, Any]
"""A state dict, or a meta, as a store is given it."""

Metrics = Mapping[str, float] | None
"""A record's metrics, where a store ranks its steps by one."""


class SaveSlot:
    """The one save of a store that may be running in the background, and the newest that completed.

    A store (`CheckpointStore`, `LocalStore`) starts a save into `_pending`
    and names its `directory`; `remove_unfinished(step)` clears what a
    failed save left.
    """

    directory: Path

    def __init__(self) -> None:
        self._pending: BackgroundSave | OrbaxAsyncSave | None = None
        self.completed: tuple[int, float | None] | None = None
        """The step and seconds (start to end) of the newest save that `wait` saw complete."""

    def save(self, step: int, state_dict: Tree, meta: Tree, metrics: Metrics = None) -> None:
        """Starts a save of one step: it runs in the background until `wait` (the arrays are read there).

        The arrays must not be donated, deleted or changed until the save is
        done; TrainLoop's records hold read-only host copies that nothing donates.

        Raises:
            CheckpointSaveError: the previous save failed (or this one, where it fails as it starts).
            CheckpointError: `step` is already saved (nothing saved is ever overwritten).
        """
        self.wait()
        self._start(step, state_dict, meta, metrics, saved=self._holds(step))

    def in_flight(self) -> bool:
        """Whether a save started here still runs, asked without waiting.

        A save that ended well is `completed` from then; one that failed is
        raised by the next `wait` or `save`.
        """
        pending = self._pending
        if pending is None:
            return False
        if not pending.finished:
            return True
        if pending.succeeded and pending.seconds is not None:
            self.completed = (pending.step, pending.seconds)
        return False

    def _holds(self, step: int) -> bool:
        """Whether this store holds `step` already (asked before each save)."""
        raise NotImplementedError

    def _start(self, step: int, state_dict: Tree, meta: Tree, metrics: Metrics, *, saved: bool) -> None:
        """Starts the save into `_pending`; refuses it (`refuse_replacing`) where `saved`."""
        raise NotImplementedError

    def remove_unfinished(self, step: int | None = None) -> list[Path]:
        raise NotImplementedError

    def refuse_replacing(self, step: int) -> CheckpointError:
        """The error of a save of a step that this store holds already (nothing saved is ever replaced)."""
        return CheckpointError(f"{self.directory} already holds step {step}; a saved checkpoint is never replaced.")

    def prune_aside(self, suffix: str, keep: int) -> list[Path]:
        """Removes all but the `keep` steps set aside last as `<step><suffix>`; returns those removed."""
        return prune_aside(self.directory, suffix, keep)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Waits for the pending save, then releases the store.

        A Ctrl-C while waiting leaves the store open with its save pending:
        the next `close()`, `wait()` or the end of the script waits for it.

        Raises:
            CheckpointSaveError: the pending save failed.
            KeyboardInterrupt: Ctrl-C while waiting.
        """
        try:
            self.wait()
        except KeyboardInterrupt:
            raise  # still pending: nothing is released
        except BaseException:
            self._release()
            raise
        self._release()

    def _release(self) -> None:
        background.untrack(self)

    def settle(self) -> None:
        """Waits for the pending save without raising; a failure is raised by the next `wait()`."""
        if self._pending is not None:
            try:
                self._pending.join()
            except Exception:  # noqa: BLE001, S110 - kept in the pending save for wait()
                pass

    def wait(self) -> None:
        """Waits for the pending save.

        Raises:
            CheckpointSaveError: the pending save failed, naming its step.
        """
        pending = self._pending
        if pending is None:
            return
        try:
            pending.join()  # a Ctrl-C here leaves the save pending, for the next wait
        except Exception as error:
            self._pending = None
            deleted = "deleted" in str(error).lower()
            hint = " (its arrays were donated or deleted before they were read: save a copy)" if deleted else ""
            failed = (
                f"saving the checkpoint of step {pending.step} to {self.directory} failed in the background"
                f"{hint}: {damage.summary(error)}"
            )
            try:
                removed = self.remove_unfinished(pending.step)
            except Exception as cleanup:  # a bucket gone for good: the save's own error stays the one raised
                raise CheckpointSaveError(
                    f"{failed}; removing its partial files failed too ({type(cleanup).__name__}: {cleanup}): the "
                    "next writer of the directory removes them"
                ) from cleanup
            partial = "; its partial files were removed" if removed else ""
            raise CheckpointSaveError(failed + partial) from error
        self._pending = None
        self.completed = (pending.step, pending.seconds)


def aside(step_dir: Path, suffix: str) -> Path:
    """A free name to move a step's directory out of the listing: `<step><suffix>`, else `<step><suffix>-<n>`."""
    target, n = step_dir.with_name(f"{step_dir.name}{suffix}"), 1
    while target.exists():
        n += 1
        target = step_dir.with_name(f"{step_dir.name}{suffix}-{n}")
    return target


def _set_aside_order(path: Path) -> tuple[int, int, str]:
    """When a step was set aside: on a disk its directory's ctime (a rename sets it); in a bucket, where folders
    have no time, by step and then its `-<n>`."""
    if not locations.is_url(path):
        return (path.stat().st_ctime_ns, 0, path.name)
    step, _, n = path.name.partition("-")
    return (int(step.split(".")[0]), int(n or 1), path.name)


def prune_aside(directory: Path, suffix: str, keep: int) -> list[Path]:
    """Removes all but the `keep` steps set aside last in `directory` as `<step><suffix>`; returns those removed."""
    if not directory.is_dir():
        return []
    pattern = re.compile(rf"\d+{re.escape(suffix)}(-\d+)?")
    aside = [path for path in directory.iterdir() if pattern.fullmatch(path.name) and path.is_dir()]
    aside.sort(key=_set_aside_order)
    removed = aside[: max(0, len(aside) - keep)]
    for path in removed:
        locations.remove_tree(path)
    return removed


def remove_until_quiet(unfinished: Callable[[], list[Path]]) -> list[Path]:
    """Removes what `unfinished` lists until it stays empty (at most `VANISHING_SECONDS`); returns what it removed.

    A failed save's last writes can still land on tensorstore's threads after
    its failure was raised: a folder that comes back is removed again.
    """
    removed = {path: None for path in unfinished()}
    deadline = time.monotonic() + VANISHING_SECONDS
    while removed:
        for path in unfinished():
            locations.remove_tree(path)
            removed[path] = None
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return list(removed)
