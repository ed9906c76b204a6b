"""The goodput ledger: an append-only log of a run's time in its run directory (`goodput.jsonl`).

The run directory's `CheckpointFileWriter` keeps it: it owns the directory
and sees every record and save. One JSON object a line, written by the
primary process, flushed at each event (so a `kill -9` loses at most the
line being written; a torn last line is skipped when read) and fsync'd by a
thread of its own within a second (the end of a session waits for it):

- `session`: a process started the run (its start on the wall clock,
  seconds of start-up and of restoring, the step resumed from, processes,
  devices), written with the session's first record;
- `record`: each record (its step and steps, seconds training, compiling,
  waiting for the data and for the host, and outside the loop before it);
- `save`: each save (the seconds the writer's call blocked);
- `completed`: a save known to be complete (at the next save or wait), with
  its seconds from start to end (it runs in the background);
- `end`: the final or preempted record, after its save is on disk.

`flaxstate.goodput` adds the events up. A ledger holds one run: at its first
event a writer moves a ledger of another run aside (`goodput-<run id>.jsonl`,
kept), so two runs never mix.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

import jax

from flaxstate.records import Checkpoint

FILENAME = "goodput.jsonl"
SYNC_SECONDS = 1.0
"""At most one fsync a second: the lines written within it share the next (a machine's crash loses at most that)."""
logger = logging.getLogger("flaxstate")


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The events of a ledger file, oldest first; lines that do not parse (a torn last line) are skipped.

    Raises:
        FileNotFoundError: no ledger at `path`.
    """
    events = []
    with open(path, encoding="utf-8") as ledger_file:
        for line in ledger_file:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and "event" in event:
                events.append(event)
    return events


def run_of(run_dir: str | Path) -> str | None:
    """The run that a run directory's ledger belongs to (its newest event's), or `None` where it has none."""
    try:
        events = read_events(Path(run_dir) / FILENAME)
    except OSError:
        return None
    return next((event["run_id"] for event in reversed(events) if isinstance(event.get("run_id"), str)), None)


class Ledger:
    """Appends a run's events to `run_dir/goodput.jsonl` (on the primary process; elsewhere does nothing).

    Args:
        run_dir: the run's directory.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / FILENAME
        self._primary = jax.process_index() == 0
        self._run_id: str | None = None
        self._session_written = False
        self._failed = False
        self._last_completed: int | None = None
        self._file: IO[str] | None = None
        self._syncer: _Syncer

    def record(self, checkpoint: Checkpoint) -> None:
        """Logs a record (and, at a session's first record, the session)."""
        if not self._primary or checkpoint.run_id is None:
            return
        if self._run_id != checkpoint.run_id:
            self._claim(checkpoint.run_id)
        if not self._session_written and checkpoint.session is not None:
            session = checkpoint.session
            self._append(
                {
                    "event": "session",
                    "time": session.started,
                    "pid": os.getpid(),
                    "startup": session.startup,
                    "restore": session.restore,
                    "restored_step": session.restored_step,
                    "processes": session.n_processes,
                    "devices": session.n_devices,
                    "device_kind": session.device_kind,
                }
            )
            self._session_written = True
        self._append(
            {
                "event": "record",
                "step": int(checkpoint.step),
                "steps": int(checkpoint.n_completed_steps),
                "elapsed": checkpoint.elapsed_time,
                "compile": checkpoint.compile_time,
                "data_wait": checkpoint.data_time,
                "idle": checkpoint.idle_time,
                "outside": checkpoint.outside_time,
                "preempted": checkpoint.preempted,
            }
        )

    def saved(self, step: int, blocking: float, completed: tuple[int, float | None] | None = None) -> None:
        """Logs a save of `step` that blocked the writer's call for `blocking` seconds.

        Args:
            completed: the step and seconds (start to end) of the newest save
                known to be complete (the previous one, waited for by this
                save, or this one): logged once each as `completed`.
        """
        if self._primary and self._run_id is not None:
            self._append({"event": "save", "step": step, "blocking": blocking})
            self._completed(completed)

    def end(self, checkpoint: Checkpoint, completed: tuple[int, float | None] | None = None) -> None:
        """Logs the end of a session: its final or preempted record is on disk."""
        if self._primary and self._run_id is not None:
            self._completed(completed)
            self._append({"event": "end", "step": int(checkpoint.step), "preempted": checkpoint.preempted}, sync=True)

    def _completed(self, completed: tuple[int, float | None] | None) -> None:
        if completed is not None and completed[0] != self._last_completed and completed[1] is not None:
            self._last_completed = completed[0]
            self._append({"event": "completed", "step": completed[0], "seconds": completed[1]})

    def _claim(self, run_id: str) -> None:
        """Moves a ledger of another run aside (kept as `goodput-<its run id>.jsonl`)."""
        self._run_id = run_id
        try:
            self._set_aside_others(run_id)
        except OSError as error:
            logger.warning("the goodput ledger %s could not be read (%s); training goes on.", self.path, error)

    def _set_aside_others(self, run_id: str) -> None:
        if self.path.exists():
            runs = {event["run_id"] for event in read_events(self.path) if "run_id" in event}
            other = next((run for run in sorted(runs) if run != run_id), None)
            if other is not None:
                target, n = self.path.with_name(f"goodput-{other}.jsonl"), 1
                while target.exists():
                    n += 1
                    target = self.path.with_name(f"goodput-{other}-{n}.jsonl")
                self.path.rename(target)
            elif self.path.stat().st_size:
                with open(self.path, "rb+") as ledger_file:  # a line torn by a kill ends, so the next one parses
                    ledger_file.seek(-1, os.SEEK_END)
                    if ledger_file.read(1) != b"\n":
                        ledger_file.write(b"\n")

    def _append(self, event: dict[str, Any], sync: bool = False) -> None:
        """Appends one line, flushed to the system at once (a `kill -9` keeps it) and fsync'd soon after.

        The fsync runs on a thread of its own, at most once each
        `SYNC_SECONDS` (it costs about 160 us, twice a small model's step,
        and on a CPU it takes a core from the steps); `sync=True` waits for it. A failure to write (a
        full disk) is warned of once and costs only the line.
        """
        event = {"time": time.time(), **event, "run_id": self._run_id}
        line = json.dumps(event, allow_nan=True) + "\n"
        try:
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115  open for the writer's life
                self._syncer = _Syncer(self._file.fileno())
            self._file.write(line)
            self._file.flush()
            if sync:
                os.fsync(self._file.fileno())
            else:
                self._syncer.request()
        except OSError as error:
            if not self._failed:
                logger.warning("the goodput ledger %s could not be written (%s); training goes on.", self.path, error)
            self._failed = True

    def close(self) -> None:
        """Syncs and closes the ledger's file (the writer's `close` does this)."""
        if self._file is not None:
            self._syncer.stop()
            try:
                os.fsync(self._file.fileno())
            except OSError:
                pass
            self._file.close()
            self._file = None


class _Syncer:
    """A thread that fsyncs a file after writes, so that the writer's call does not wait for the disk."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._wanted = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flaxstate-ledger-fsync", daemon=True)
        self._thread.start()

    def request(self) -> None:
        self._wanted.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wanted.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._stopping.is_set():
                return
            try:
                os.fsync(self._fd)
            except OSError:
                return
            if self._stopping.wait(SYNC_SECONDS):  # the lines written meanwhile share the next fsync
                return
