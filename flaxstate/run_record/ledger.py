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
  waiting for the data and for the host, and outside the loop before it,
  memory, and its fingerprints: `from`, the previous record's step,
  `state_fp` and `data_fp`, see `flaxstate.run_record.fingerprints`);
- `audit`: a resumed session's verdict on its replay (`flaxstate.run_record.audit`),
  once it is known: at the first difference, at the end of the replay, or at
  the session's end;
- `save`: each save (the seconds the writer's call blocked);
- `completed`: a save known to be complete (at the next save or wait), with
  its seconds from start to end (it runs in the background);
- `cadence`: a change of `every="auto"`'s interval between saves, with its
  inputs (`flaxstate.checkpoint.schedule`);
- `end`: the final or preempted record, after its save is on disk.

`flaxstate.run_record.goodput` adds the events up. A ledger holds one run: at its first
event a writer moves a ledger of another run aside (`goodput-<run id>.jsonl`,
kept), so two runs never mix.

A bucket has no append and no rename: there each session's events are one
object, `goodput-sessions/<start in ns>-<pid>.jsonl`, written again whole by
the same thread at most once a second (the rate at which Google Cloud
Storage takes writes to one object name), so a `kill -9` loses at most the
last second's events, and a torn object is never seen: an object is written
whole or not at all. `run_events` reads a run directory's events either way: the
file, or the sessions of the newest run in the order they started.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import jax

from flaxstate import clusters, settings
from flaxstate.locations import as_path, is_url
from flaxstate.records import MEMORY_FIELDS, Checkpoint
from flaxstate.run_record import audit
from flaxstate.run_record.cadence import RunHistory
from flaxstate.run_record.goodput import SessionEvents, sessions_of

FILENAME = "goodput.jsonl"
SESSIONS = "goodput-sessions"
"""The folder of a bucket's ledger: one object a session."""
SYNC_SECONDS = 1.0
"""At most one fsync a second: the lines written within it share the next (a machine's crash loses at most that)."""
logger = logging.getLogger("flaxstate")


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The events of a ledger file, oldest first; lines that do not parse are skipped (`_parse`).

    Raises:
        FileNotFoundError: no ledger at `path`.
    """
    with open(path, "rb") as ledger_file:
        return _parse(ledger_file.read(), path)


_WARNED: set[tuple[str, int]] = set()
"""The ledgers (and their counts of damaged lines) warned of in this process: one warning each, however often the
writer and the command line read them."""


def _parse(data: bytes, where: str | Path) -> list[dict[str, Any]]:
    """A ledger's events from its bytes. A line that is not an event (bytes that are not UTF-8, as a torn write on a
    full disk or a flipped bit leaves them; text that is not JSON) is skipped, with one warning naming the first;
    a last line without its newline (a kill during a write) is skipped silently."""
    lines = data.split(b"\n")
    events, damaged = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            event = json.loads(line.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError and json's JSONDecodeError alike
            event = None
        if isinstance(event, dict) and "event" in event:
            events.append(event)
        elif number < len(lines):  # a line that ended: damaged, not merely cut short
            damaged.append(number)
    if damaged and (str(where), len(damaged)) not in _WARNED:
        _WARNED.add((str(where), len(damaged)))
        logger.warning(
            "the goodput ledger %s has %d damaged line(s) (line %d first: not UTF-8 or not a JSON event); "
            "skipped, the rest is read.",
            where,
            len(damaged),
            damaged[0],
        )
    return events


def run_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """The events of a run directory's ledger, oldest first: its file, or in a bucket its newest run's sessions.

    Raises:
        FileNotFoundError: the directory holds no ledger.
    """
    directory = as_path(run_dir)
    if not is_url(directory):
        return read_events(directory / FILENAME)
    folder = directory / SESSIONS
    sessions = sorted(folder.iterdir(), key=lambda path: path.name) if folder.is_dir() else []
    if not sessions:
        raise FileNotFoundError(f"{folder} holds no session of a goodput ledger")
    by_session = [_parse(path.read_bytes(), path) for path in sessions]
    run = _newest_run([event for events in by_session for event in events])
    return [event for events in by_session for event in events if event.get("run_id") == run]


def _newest_run(events: list[dict[str, Any]]) -> str | None:
    return next((event["run_id"] for event in reversed(events) if isinstance(event.get("run_id"), str)), None)


def run_of(run_dir: str | Path) -> str | None:
    """The run that a run directory's ledger belongs to (its newest event's), or `None` where it has none."""
    try:
        return _newest_run(run_events(run_dir))
    except OSError:
        return None


class Ledger:
    """Appends a run's events to `run_dir/goodput.jsonl`, or in a bucket to its session's object (see the module).

    On the primary process; elsewhere it does nothing.

    Args:
        run_dir: the run's directory.
    """

    def __init__(self, run_dir: Path) -> None:
        self._bucket = is_url(run_dir)
        self.path = run_dir / (SESSIONS if self._bucket else FILENAME)
        self._primary = jax.process_index() == 0
        self._run_id: str | None = None
        self._session_written = False
        self._failed = False
        self._last_completed: int | None = None
        self._file: IO[str] | _SessionObject | None = None
        self._syncer: _Syncer
        self._earlier: list[SessionEvents] = []
        """The sessions before this one (read at a resumed session's first record), for its audit."""
        self._mine: SessionEvents | None = None
        """This session's events, while its replay is audited (then `None`)."""
        self.history: RunHistory | None = None
        """The run's failures (sessions that ended without their final or preempted record) and seconds of
        running before this session, once read at the session's first record (on the primary process)."""
        self._replay_end: int | None = None
        """The newest step that the sessions before this one recorded: this one's replay ends there."""

    def record(self, checkpoint: Checkpoint) -> None:
        """Logs a record (and, at a session's first record, the session)."""
        if not self._primary or checkpoint.run_id is None:
            return
        if self._run_id != checkpoint.run_id:
            self._claim(checkpoint.run_id)
        if not self._session_written and checkpoint.session is not None:
            session = checkpoint.session
            started = {
                "event": "session",
                "time": session.started,
                "pid": os.getpid(),
                "startup": session.startup,
                "restore": session.restore,
                "restored_step": session.restored_step,
                "restored_fp": session.restored_fingerprint,
                "processes": session.n_processes,
                "devices": session.n_devices,
                "device_kind": session.device_kind,
                "microbatches": session.n_microbatches,
                "max_device_batch": session.max_device_batch,
                "programs": session.programs,
                "manager": clusters.manager(),
            }
            if session.restored_step is not None:
                self._begin_audit(started)
            self.history = RunHistory(
                sum(not earlier.ended for earlier in self._earlier),
                sum(max(earlier.last_time - float(earlier.start["time"]), 0.0) for earlier in self._earlier),
            )
            self._append(started)
            self._session_written = True
        step = int(checkpoint.step)
        record = {
            "event": "record",
            "step": step,
            "steps": int(checkpoint.n_completed_steps),
            "from": step - int(checkpoint.n_completed_steps),
            "elapsed": checkpoint.elapsed_time,
            "compile": checkpoint.compile_time,
            "data_wait": checkpoint.data_time,
            "idle": checkpoint.idle_time,
            "outside": checkpoint.outside_time,
            "preempted": checkpoint.preempted,
            "rolled_back": checkpoint.timing.rolled_back_time,
            "state_fp": checkpoint.state_fingerprint,
            "data_fp": checkpoint.data_fingerprint,
            **{name: getattr(checkpoint, name) for name in MEMORY_FIELDS},
        }
        for rolled in checkpoint.rollbacks:  # those made in this record's steps: they went back to its start
            if int(rolled["to_step"]) == record["from"]:
                self._append({"event": "rollback", **rolled})
        self._append(record)
        self._audit(record)

    def _begin_audit(self, started: dict[str, Any]) -> None:
        """Reads the sessions before this resumed one, whose records its replay is checked against."""
        try:
            self._earlier = sessions_of(run_events(self.path.parent))
        except OSError:
            self._earlier = []
        self._mine = SessionEvents(started)
        self._replay_end = audit.replay_end(self._earlier)

    def _audit(self, record: dict[str, Any], ending: bool = False) -> None:
        """Logs and keeps the resume's verdict once it is known (see `flaxstate.run_record.audit`)."""
        mine = self._mine
        if mine is None:
            return
        if not ending:
            mine.records.append(record)
        resume = audit.verdict(self._earlier, mine, len(self._earlier) + 1)
        end = self._replay_end
        if resume is None or not (ending or resume.differs or end is None or int(record["step"]) >= end):
            return
        self._mine = None
        (logger.info if resume.verified else logger.warning)("%s", resume.line())
        self._append({"event": "audit", **resume.to_json()})

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

    def cadence(self, change: Mapping[str, Any]) -> None:
        """Logs a change of `AutoInterval`'s interval, with its inputs (`IntervalChange.event()` of
        `flaxstate.checkpoint.schedule`)."""
        if self._primary and self._run_id is not None:
            self._append({"event": "cadence", **change})

    def end(self, checkpoint: Checkpoint, completed: tuple[int, float | None] | None = None) -> None:
        """Logs the end of a session: its final or preempted record is on disk."""
        if self._primary and self._run_id is not None:
            self._completed(completed)
            self._audit({}, ending=True)  # a replay cut short: what it compared
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
        if not self._bucket and self.path.exists():  # in a bucket, each session's object names its run
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
        line = json.dumps(event, allow_nan=True, default=settings.plain) + "\n"
        try:
            if self._file is None:
                if self._bucket:
                    self._file = _SessionObject(self.path / f"{time.time_ns():020d}-{os.getpid()}.jsonl")
                    self._syncer = _Syncer(self._file.sync)
                else:
                    self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115  open for the writer's life
                    self._syncer = _Syncer(functools.partial(os.fsync, self._file.fileno()))
            self._file.write(line)
            self._file.flush()
            if sync:
                self._syncer.sync()
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
                self._syncer.sync()
            except OSError:
                pass
            self._file.close()
            self._file = None


class _SessionObject:
    """A session's ledger in a bucket: its lines, written whole as one object at each `sync`."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)

    def flush(self) -> None:
        """Nothing: an object is written at `sync`."""

    def sync(self) -> None:
        with self._lock:
            text = "".join(self._lines)
        try:
            self._path.write_text(text)
        except OSError:
            raise
        except Exception as error:  # the bucket client's own errors (HTTP, credentials)
            raise OSError(f"{self._path}: {type(error).__name__}: {error}") from error

    def close(self) -> None:
        """Nothing to release (the last `sync` wrote every line)."""


class _Syncer:
    """A thread that makes writes durable (a file's fsync, a session object's upload) after them, so that the
    writer's call does not wait for the disk or the bucket."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
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
                self.sync()
            except OSError:  # the final sync (`close`, an `end` event) tries again and warns
                pass
            if self._stopping.wait(SYNC_SECONDS):  # the lines written meanwhile share the next fsync
                return
