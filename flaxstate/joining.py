"""The join of a run's processes (`jax.distributed.initialize()`), checked before it waits and watched while it does.

JAX's join is silent: a process that cannot reach its coordinator, or waits
for processes that will never come (a `num_processes` that is not the count
the manager started), waits out `initialization_timeout` (300 s by default)
and then fails with a gRPC deadline; a coordinator address on the loopback
interface in a job of several nodes makes each node look for the coordinator
on itself. Importing flaxstate puts a checked copy of each cluster
environment it knows (SLURM's and Open MPI's of JAX, flaxstate launch's)
ahead of the original (`clusters.py`); asked for this process's id, before
any client is made, the copy calls `check` and `wait_for_coordinator` here,
then `watch` reports the rest of the join until it ends.

What a user sets: `jax.distributed.initialize(initialization_timeout=S)`,
JAX's own, is how long a process waits for the coordinator and then for the
others; it waits that long for the coordinator here and as long again in
JAX's join at most. Every 30 s of waiting (`FLAXSTATE_JOIN_REPORT_SECONDS`)
the process says on stderr how long it has waited, for whom, and how long it
will wait in all.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

from flaxstate import private_apis

REPORT_EVERY_VARIABLE = "FLAXSTATE_JOIN_REPORT_SECONDS"
"""The variable that sets the seconds between two lines of a process that waits to join (30 by default)."""


def report_every() -> float:
    """Seconds between two lines of a process that waits to join (`FLAXSTATE_JOIN_REPORT_SECONDS`, or 30)."""
    return float(os.environ.get(REPORT_EVERY_VARIABLE, "30"))


PROBE_EVERY = 0.5
"""Seconds between two tries to reach the coordinator."""


class JoinError(RuntimeError):
    """The processes cannot join as they are started: one line with the cause and the fix."""


@dataclass(frozen=True)
class Join:
    """What one process was told to join, from its manager and from the arguments of the call.

    Attributes:
        manager: who started the processes, as a user names it (`"srun"`, `"mpirun"`, `"flaxstate launch"`).
        started: the processes the manager started (its own count: `SLURM_NTASKS`, `OMPI_COMM_WORLD_SIZE`).
        count_from: where the manager says `started` (a variable's name), for the error.
        nodes: the machines the processes run on, or `None` where the manager does not say.
        coordinator: the coordinator's `host:port` that this process will use.
        num_processes: the count that the join will wait for (the call's, or else the manager's).
        process_id: this process's id in the join.
        timeout: seconds the join waits (`initialization_timeout`).
        fix_count: how to start as many processes as asked, for the error (`"srun -n 4"`).
    """

    manager: str
    started: int
    count_from: str
    nodes: int | None
    coordinator: str
    num_processes: int
    process_id: int
    timeout: float
    fix_count: str

    @property
    def who(self) -> str:
        return f"process {self.process_id} of {self.num_processes} (started by {self.manager})"


def is_loopback(address: str) -> bool:
    """Whether `host:port` names this machine's loopback interface (`localhost`, `127.x.x.x`, `[::1]`)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check(join: Join) -> None:
    """Refuses a join that can never complete, in one line that names the cause and the fix.

    Raises:
        JoinError: the count asked for is not the count the manager started, or the coordinator's address is
            the loopback interface in a job of several nodes.
    """
    if join.num_processes != join.started:
        raise JoinError(
            f"jax.distributed.initialize() would wait for {join.num_processes} processes, and {join.manager} "
            f"started {join.started} ({join.count_from}={join.started}): the join would wait out its "
            f"{join.timeout:g} s for processes that never come. Leave num_processes out (JAX reads it from "
            f"{join.count_from}), or start {join.num_processes} ({join.fix_count})."
        )
    if join.nodes is not None and join.nodes > 1 and is_loopback(join.coordinator):
        raise JoinError(
            f"the coordinator's address {join.coordinator} is this machine's loopback interface, and the "
            f"{join.started} processes run on {join.nodes} nodes: each node would look for the coordinator on "
            "itself. Give the address of process 0's node (its host name), or leave coordinator_address and "
            f"JAX_COORDINATOR_ADDRESS unset for {join.manager} to say it."
        )


def _reach(address: str) -> str | None:
    """Why the coordinator at `host:port` cannot be reached now (one clause), or `None` where it answers."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=min(PROBE_EVERY * 4, 5.0)):
            return None
    except socket.gaierror as error:
        return f"its host {host} does not resolve here ({error.strerror})"
    except OSError as error:
        return f"nothing answers there ({error.strerror or type(error).__name__})"


def wait_for_coordinator(join: Join, clock: Any = time.monotonic) -> None:
    """Waits until the coordinator answers (process 0 serves it, so it does not wait), saying how long it has waited.

    Raises:
        JoinError: it did not answer within the join's timeout.
    """
    if join.process_id == 0:
        return
    every = report_every()
    start = reported = clock()
    while (why := _reach(join.coordinator)) is not None:
        waited = clock() - start
        if waited >= join.timeout:
            raise JoinError(
                f"{join.who} could not reach the coordinator at {join.coordinator} (process 0's) within "
                f"{join.timeout:g} s: {why}. Check that process 0 started and is past its imports (its log), that "
                "its host resolves to it from here and the port is open between the nodes; a slow start of all "
                "the processes (a cold restart) needs a longer jax.distributed.initialize(initialization_timeout=S)."
            )
        if clock() - reported >= every:
            reported = clock()
            _say(
                f"{join.who} has waited {waited:.0f} s for the coordinator at {join.coordinator} (process 0's): "
                f"{why}; it waits {join.timeout:g} s in all (initialization_timeout)."
            )
        time.sleep(PROBE_EVERY)


def watch(join: Join, initialize: FrameType | None, clock: Any = time.monotonic) -> threading.Thread | None:
    """Says every `report_every()` seconds, while the calling thread is still in `initialize` (JAX's join), how long
    this process has waited for the others; returns the watching thread (`None` without a frame to watch)."""
    if initialize is None:
        return None
    caller = threading.get_ident()
    every = report_every()
    start = clock()

    def joining() -> bool:
        frame = sys._current_frames().get(caller)
        while frame is not None:
            if frame is initialize:
                return True
            frame = frame.f_back
        return False

    def report() -> None:
        reported = start
        while joining():
            if clock() - reported >= every:
                reported = clock()
                others = join.num_processes - 1
                _say(
                    f"{join.who} has waited {reported - start:.0f} s in jax.distributed.initialize for the other "
                    f"{others} process{'es' if others != 1 else ''} to join at the coordinator {join.coordinator}; "
                    f"it waits {join.timeout:g} s in all (initialization_timeout)."
                )
            time.sleep(min(PROBE_EVERY, every))

    thread = threading.Thread(target=report, name="flaxstate-join-watch", daemon=True)
    thread.start()
    return thread


def _say(line: str) -> None:
    sys.stderr.write(f"flaxstate: {line}\n")  # one write: a manager that tags its processes' output tags it once
    sys.stderr.flush()


_last_asked: list[FrameType] = []
"""The frame of the last auto-detection that `jax_join_frames` answered (held, so that no other has its id)."""


def jax_join_frames() -> tuple[dict[str, Any], FrameType | None] | None:
    """The arguments of the `jax.distributed.initialize` call that is asking (its auto-detection's locals: the
    coordinator's address, `num_processes`, `process_id`, `initialization_timeout`), and the frame of JAX's join
    (`State.initialize`); `None` where the caller is not JAX's auto-detection, or where this call of it was
    answered before (an environment is asked for the process's id and then for its local id)."""
    codes = private_apis.join_code()
    if codes is None:  # pragma: no cover - a JAX that moved them: the join goes unchecked, as JAX alone has it
        return None
    detect_code, join_code = codes
    frame: FrameType | None = sys._getframe(1)
    detect = None
    while frame is not None:
        if detect is None and frame.f_code is detect_code:
            if _last_asked and _last_asked[0] is frame:
                return None
            detect = frame
        elif detect is not None and frame.f_code is join_code:
            break
        frame = frame.f_back
    if detect is None:
        return None
    _last_asked[:] = [detect]
    return dict(detect.f_locals), frame
