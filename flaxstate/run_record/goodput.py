"""Where a run's time went: the goodput ledger's events added up, per session and in total.

A session is one process's part of a run, from the process's start to its
last event in the ledger (`flaxstate.run_record.ledger`). Its wall time is
split into productive step time and buckets of lost time:

- `startup`: the process's start to the state created or restored (imports,
  the restore, the data's first batch);
- `compile`: tracing and compiling, within the records' training time;
- `data_wait`: the devices waiting for the data;
- `host_idle`: the devices waiting for the host otherwise;
- `checkpoint`: the writer's calls blocking on saves;
- `save_drag`: the steps' time lost to saves running in the background: the
  records' step time while a save was in flight beyond their step time while
  none was (`flaxstate.run_record.cadence.save_drag`), out of the productive time;
- `lost_progress`: the productive time of steps that the next session
  trained again, because it resumed from an earlier step (a `kill -9`
  between checkpoints): `lost_steps` of them;
- `rolled_back`: the training that rollbacks threw away (`fs.Rollback`: the
  steps from the last good record to a bad loss);
- `outside_loop`: the rest, between records: evaluation, other writers and
  the caller's code (and what the ledger cannot see, such as the steps a
  killed session trained after its last record);
- `down_time`: the gap before a session, from the previous session's last
  event to this one's process start (in the total: all gaps).

Each session also says which cluster manager started it and its restart of
the job (`manager`: `flaxstate.clusters.manager()`, such as `{"name": "slurm",
"job": "81", "restarts": 1}` after a requeue; `None` where none said).

`productive` plus the buckets equals `wall_time`; `goodput` is
`productive / wall_time`. A ledger cut short (a process killed right after
its session line) ends its session no earlier than its events account for,
so no bucket is negative.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from flaxstate.run_record import cadence

BUCKETS = (
    "startup",
    "compile",
    "data_wait",
    "host_idle",
    "outside_loop",
    "checkpoint",
    "save_drag",
    "lost_progress",
    "rolled_back",
    "down_time",
)
"""The buckets of lost time, in the order `flaxstate goodput` prints them."""


@dataclasses.dataclass
class SessionEvents:
    """One session's events: its `session` line, records and saves, the time of its last event, and whether it ended."""

    start: dict[str, Any]
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    saves: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    audits: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    completed: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    cadences: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    last_time: float = 0.0
    ended: bool = False


def sessions_of(events: Iterable[dict[str, Any]]) -> list[SessionEvents]:
    """The events grouped by session (the newest run's only), oldest first."""
    events = list(events)
    runs = [event.get("run_id") for event in events if event.get("event") == "session"]
    run_id = runs[-1] if runs else None
    sessions: list[SessionEvents] = []
    seen: set[tuple[Any, Any, Any]] = set()
    for event in events:
        if event.get("run_id") != run_id:
            continue
        kind = event.get("event")
        if kind == "session":
            # A second writer of one loop writes its loop's very session line: the same session. A second loop of
            # the process (a notebook, a test) shares the pid and, up to /proc's jitter, the start; its startup
            # (the time from that start to its own state) is its own.
            key = (event.get("pid"), event.get("time"), event.get("startup"))
            if key in seen:
                continue
            seen.add(key)
            sessions.append(SessionEvents(event, last_time=float(event["time"])))
            continue
        if not sessions:
            continue
        session = sessions[-1]
        session.last_time = max(session.last_time, float(event.get("time", session.last_time)))
        if kind == "record":
            session.records.append(event)
        elif kind == "audit":
            session.audits.append(event)
        elif kind == "save":
            session.saves.append(event)
        elif kind == "completed":
            session.completed.append(event)
        elif kind == "cadence":
            session.cadences.append(event)
        elif kind == "end":
            session.ended = True
    # In the ledger's order: a session's line is written at its first record, after the previous session's
    # events. Two sessions of one process (two loops in a notebook) share a start that /proc gives with
    # microseconds of jitter, so sorting by it could swap them.
    return sessions


PEAKS = ("host_memory_peak", "device_memory_peak")
"""The memory peaks a report gives (bytes, `None` where no record knew them): a session's records' highest."""


def _peak(values: Iterable[Any]) -> int | None:
    known = [int(value) for value in values if value is not None]
    return max(known) if known else None


def _productive(record: dict[str, Any]) -> float:
    return max(float(record["elapsed"]) - float(record["compile"]) - float(record["idle"]), 0.0)


def _audit(session: SessionEvents) -> dict[str, Any] | None:
    """The resume audit's verdict that the session's writer logged (`flaxstate.run_record.audit`), or `None`."""
    if not session.audits:
        return None
    logged = session.audits[-1]
    names = ("verdict", "replayed", "first_different_step", "against", "not_compared")
    return {name: logged.get(name) for name in names}


def _drags(session: SessionEvents) -> list[float]:
    """Each record's seconds lost to saves in the background (`flaxstate.run_record.cadence.save_drag`), on the wall
    clock of the ledger's events: a save runs from its call's start for the seconds its `completed` event gives."""
    durations = {int(event["step"]): float(event["seconds"]) for event in session.completed}
    windows = []
    for save in session.saves:
        seconds = durations.get(int(save["step"]))
        if seconds is not None:
            start = float(save["time"]) - float(save["blocking"])
            windows.append((start, start + seconds))
    intervals = [
        cadence.Interval.ending(float(event["time"]), float(event["elapsed"]), _productive(event), int(event["steps"]))
        for event in session.records
    ]
    return cadence.save_drag(intervals, windows)


def _cadence(session: SessionEvents) -> dict[str, Any]:
    """`every="auto"`'s last interval in the session and the loss a failure was expected to cost at it."""
    if not session.cadences:
        return {"save_interval": None, "expected_loss_per_failure": None}
    last = session.cadences[-1]
    return {"save_interval": float(last["interval"]), "expected_loss_per_failure": float(last["expected_loss"])}


def _account(session: SessionEvents, resumed_at: int | None, down_time: float) -> dict[str, Any]:
    """One session's wall time split; `resumed_at`: the step the next session resumed from (`None`: none)."""
    seen = max(session.last_time - float(session.start["time"]), 0.0)
    lost_steps, lost_seconds, productive, drag = 0, 0.0, 0.0, 0.0
    for record, dragged in zip(session.records, _drags(session), strict=True):
        seconds, n_steps, step = _productive(record), int(record["steps"]), int(record["step"])
        lost = 0 if resumed_at is None else max(0, min(n_steps, step - resumed_at))
        lost_steps += lost
        if n_steps:
            lost_seconds += seconds * lost / n_steps
            drag += dragged * (n_steps - lost) / n_steps  # a lost record's time is all lost progress
        productive += seconds
    buckets = {
        "startup": float(session.start.get("startup", 0.0)),
        "compile": sum(float(record["compile"]) for record in session.records),
        "data_wait": sum(float(record["data_wait"]) for record in session.records),
        "host_idle": sum(max(float(record["idle"]) - float(record["data_wait"]), 0.0) for record in session.records),
        "checkpoint": sum(float(save["blocking"]) for save in session.saves),
        "save_drag": drag,
        "lost_progress": lost_seconds,
        "rolled_back": sum(float(record.get("rolled_back", 0.0)) for record in session.records),
    }
    kept = productive - lost_seconds - drag
    # A ledger cut short (a kill right after the session line) knows less wall time than its events account for.
    wall = max(seen, kept + sum(buckets.values()))
    buckets["outside_loop"] = wall - kept - sum(buckets.values())
    buckets["down_time"] = down_time
    return {
        "started": float(session.start["time"]),
        "wall_time": wall + down_time,
        "goodput": kept / (wall + down_time) if wall + down_time > 0 else 0.0,
        "productive": kept,
        "lost_steps": lost_steps,
        "steps": sum(int(record["steps"]) for record in session.records),
        "last_step": max((int(record["step"]) for record in session.records), default=None),
        "restored_step": session.start.get("restored_step"),
        "preemptions": sum(bool(record.get("preempted")) for record in session.records),
        "ended": session.ended,
        "processes": session.start.get("processes"),
        "devices": session.start.get("devices"),
        "device_kind": session.start.get("device_kind"),
        "microbatches": session.start.get("microbatches"),
        "programs": session.start.get("programs"),
        "manager": session.start.get("manager"),
        "audit": _audit(session),
        "failed": not session.ended and resumed_at is not None,
        "lost_per_failure": lost_seconds if not session.ended and resumed_at is not None else None,
        **_cadence(session),
        **{name: _peak(record.get(name) for record in session.records) for name in PEAKS},
        **{name: buckets[name] for name in BUCKETS},
    }


def report(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Adds a ledger's events up (see the module's docstring).

    Args:
        events: the ledger's events, oldest first (`flaxstate.run_record.ledger.read_events`).

    Returns:
        `{"sessions": [...], "total": {...}}`: each session (oldest first) and
        the total with `wall_time`, `goodput`, `productive`, `lost_steps` and
        each of `BUCKETS` in seconds, and the memory `PEAKS` in bytes. A
        session's `wall_time` includes the down time before it. A session
        that ended without its final or preempted record and was resumed is
        `failed`, its `lost_progress` its `lost_per_failure` (the total's:
        over its `failures`); `save_interval` and `expected_loss_per_failure`
        are `every="auto"`'s last choice (`None` without it).
    """
    events = list(events)
    sessions = sessions_of(events)
    accounts: list[dict[str, Any]] = []
    for index, session in enumerate(sessions):
        following = sessions[index + 1] if index + 1 < len(sessions) else None
        resumed_at = None
        if following is not None:
            restored = following.start.get("restored_step")
            resumed_at = int(restored) if restored is not None else 0
        down = 0.0
        if accounts:  # from the previous session's end: its last event, or what its events account for
            previous = accounts[-1]
            down = max(
                float(session.start["time"]) - previous["started"] - previous["wall_time"] + previous["down_time"], 0.0
            )
        accounts.append(_account(session, resumed_at, down))
    return {"sessions": accounts, "total": _total(accounts)}


def _total(accounts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    wall = sum(account["wall_time"] for account in accounts)
    productive = sum(account["productive"] for account in accounts)
    failures = sum(account["failed"] for account in accounts)
    known = [account for account in accounts if account["save_interval"] is not None]
    return {
        "wall_time": wall,
        "goodput": productive / wall if wall > 0 else 0.0,
        "productive": productive,
        "lost_steps": sum(account["lost_steps"] for account in accounts),
        "steps": sum(account["steps"] for account in accounts),
        "preemptions": sum(account["preemptions"] for account in accounts),
        "failures": failures,
        "lost_per_failure": sum(account["lost_progress"] for account in accounts) / failures if failures else None,
        "save_interval": known[-1]["save_interval"] if known else None,
        "expected_loss_per_failure": known[-1]["expected_loss_per_failure"] if known else None,
        **{name: _peak(account[name] for account in accounts) for name in PEAKS},
        **{name: sum(account[name] for account in accounts) for name in BUCKETS},
    }


def _bytes(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**30:,.2f} GiB"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f} s"


def _verdict(logged: dict[str, Any] | None) -> str:
    if logged is None:
        return "-"
    step, not_compared = logged.get("first_different_step"), logged.get("not_compared")
    if logged["verdict"] == "unverified" and not_compared:
        return f"unverified ({not_compared} records not compared)"
    return str(logged["verdict"]) + ("" if step is None else f" at step {step}")


def _started_by(manager: dict[str, Any] | None) -> str:
    """A session's manager as the report's table gives it: `slurm, restart 1`, `flaxstate launch, restart 0`."""
    if not manager:
        return "-"
    return f"{manager['name']}, restart {manager['restarts']}"


def format_report(summary: dict[str, Any]) -> str:
    """The report as a table: a column each session and one for the total, seconds and percent of wall time."""
    columns = [(f"session {index + 1}", account) for index, account in enumerate(summary["sessions"])]
    columns.append(("total", summary["total"]))
    header = ["", *[name for name, _ in columns]]
    rows = [header]

    def cell(account: dict[str, Any], name: str) -> str:
        wall = account["wall_time"]
        share = account[name] / wall if wall > 0 else 0.0
        return f"{account[name]:,.1f} s ({share:.1%})"

    rows.append(["wall time", *[f"{account['wall_time']:,.1f} s" for _, account in columns]])
    rows.append(["productive (goodput)", *[cell(account, "productive") for _, account in columns]])
    rows += [[name.replace("_", " "), *[cell(account, name) for _, account in columns]] for name in BUCKETS]
    rows.append(["steps trained", *[str(account["steps"]) for _, account in columns]])
    rows.append(["lost steps", *[str(account["lost_steps"]) for _, account in columns]])
    rows.append(["preemptions", *[str(account["preemptions"]) for _, account in columns]])
    if any(account.get("save_interval") is not None for _, account in columns):  # AutoInterval
        rows += [
            [label, *[_seconds(account.get(name)) for _, account in columns]]
            for label, name in (
                ("save interval (auto)", "save_interval"),
                ("loss a failure, expected", "expected_loss_per_failure"),
                ("loss a failure, realized", "lost_per_failure"),
            )
        ]
    managers = [account.get("manager") for account in summary["sessions"]]
    if any(managers):  # which manager started each session, and its restart of the job
        rows.append(["started by", *[_started_by(each) for each in managers], ""])
    audits = [account.get("audit") for account in summary["sessions"]]
    if any(audits):
        rows.append(["resume audit", *[_verdict(each) for each in audits], ""])
    for name in PEAKS:
        if any(account[name] is not None for _, account in columns):
            label = name.replace("_", " ").replace("memory peak", "memory, peak")
            rows.append([label, *[_bytes(account[name]) for _, account in columns]])
    widths = [max(len(row[index]) for row in rows) for index in range(len(header))]
    lines = [
        "  ".join(
            text.ljust(width) if index == 0 else text.rjust(width)
            for index, (text, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    return "\n".join(lines)
