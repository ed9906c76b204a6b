"""Runs JAX workers as separate processes, one CPU device each, joined over gloo.

Several CPU devices in one process deadlock in collectives on our machines
(shared/PLATFORM.md); several processes with one device each do not. Every
worker gets a hard timeout and is killed with SIGKILL (jax.distributed
catches SIGTERM); a failure shows every process's output.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

TESTS = Path(__file__).parents[1]
"""The folder that holds `flaxstate_testing`: workers import it from PYTHONPATH."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(n_devices: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    env.pop("XLA_FLAGS", None)
    if n_devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_devices}"
    return env


def start(script: str, config: dict, process_id: int = 0, n_processes: int = 1, port: int = 0, n_devices: int = 1):
    config = dict(config, process_id=process_id, n_processes=n_processes, port=port)
    return subprocess.Popen(
        [sys.executable, "-m", f"flaxstate_testing.workers.{script.removesuffix('.py')}", json.dumps(config)],
        env=worker_env(n_devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_all(processes: list[subprocess.Popen], timeout: float, expect_success: bool = True) -> list[str]:
    """Waits for every process; kills all at the deadline. Returns their outputs."""
    deadline = time.monotonic() + timeout
    outputs: list[str] = [""] * len(processes)
    timed_out = False
    for index, process in enumerate(processes):
        try:
            outputs[index] = process.communicate(timeout=max(0.1, deadline - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            timed_out = True
            for other in processes:
                kill(other)
            outputs[index] = process.communicate()[0]
    report = "\n".join(
        f"--- process {i} (exit {p.returncode}) ---\n{out[-4000:]}"
        for i, (p, out) in enumerate(zip(processes, outputs, strict=True))
    )
    if timed_out:
        raise AssertionError(f"workers did not finish within {timeout} s:\n{report}")
    if expect_success and any(p.returncode != 0 for p in processes):
        raise AssertionError(f"a worker failed:\n{report}")
    return outputs


def run(script: str, config: dict, n_processes: int = 1, timeout: float = 180, n_devices: int = 1) -> list[str]:
    """Runs `n_processes` workers of `script` together and returns their outputs."""
    port = free_port()
    processes = [start(script, config, i, n_processes, port, n_devices) for i in range(n_processes)]
    return wait_all(processes, timeout)


class Watched:
    """A started worker whose output is read as it comes, so that a test can act on a line (send a signal).

    Args:
        process: a worker from `start`.
    """

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._ended = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    @property
    def output(self) -> str:
        return "".join(f"{line}\n" for line in self.lines)

    def lines_with(self, text: str, count: int = 1, timeout: float = 120) -> list[str]:
        """Waits until `count` lines contain `text`, and returns them; kills the worker and fails at the deadline."""
        return self._wait_until(lambda line: text in line, count, f"{count} lines with {text!r}", timeout)

    def wait_for(self, text: str, timeout: float) -> None:
        """Waits until a line starts with `text`; kills the worker and fails if it ends or times out first."""
        self._wait_until(lambda line: line.startswith(text), 1, f"line {text!r}", timeout)

    def _wait_until(self, matches: Callable[[str], bool], count: int, what: str, timeout: float) -> list[str]:
        """Waits until `count` lines match, and returns them; kills the worker and fails if it ends first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(found := [line for line in self.lines if matches(line)]) < count:
                left = deadline - time.monotonic()
                if self._ended or left <= 0:
                    kill(self.process)
                    raise AssertionError(f"no {what} from the worker within {timeout} s:\n{self.output[-4000:]}")
                self._changed.wait(min(left, 1.0))
            return found

    def finish(self, timeout: float = 120) -> int:
        """Waits for the worker to exit (killed and failed at the deadline); returns its exit status."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill(self.process)
            self.process.wait()
            self._reader.join(10)
            raise AssertionError(f"the worker did not exit within {timeout} s:\n{self.output[-4000:]}") from None
        self._reader.join(10)
        return self.process.returncode


@contextlib.contextmanager
def reaped() -> Iterator[list[Watched]]:
    """A list for the processes a test starts, each `Watched`: all killed by their process groups and reaped when
    the block ends, whatever happened in it (a test signals them and `finish`es them inside)."""
    started: list[Watched] = []
    try:
        yield started
    finally:
        for each in started:  # every one killed before any is waited for: a wait that fails kills no fewer
            kill(each.process)
        for each in started:
            each.process.wait(timeout=30)


@contextlib.contextmanager
def watched(script: str, config: dict, n_processes: int, n_devices: int = 1) -> Iterator[list[Watched]]:
    """`n_processes` workers of `script` joined on a free port, each `Watched`, and `reaped`."""
    port = free_port()
    with reaped() as workers:
        workers.extend(Watched(start(script, config, i, n_processes, port, n_devices)) for i in range(n_processes))
        yield workers


def kill_all_after(workers: list[Watched], line: str, timeout: float) -> None:
    """Waits until every worker printed `line`, then kills them all with SIGKILL (whatever happened)."""
    try:
        for worker in workers:
            worker.wait_for(line, timeout=timeout)
    finally:
        for worker in workers:
            kill(worker.process)
            worker.finish(timeout=30)
