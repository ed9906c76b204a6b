"""The tests' shared cluster: worker processes joined over gloo once, that run the scenarios (worker scripts) asked.

A scenario that only needs several processes joined by `jax.distributed` (sharded or data-parallel equality,
global batches, imports over processes) pays for its workers' start (1.5 s of imports and 0.9 s to join a
process, and every program compiled again) once a session instead of once a test: `cluster.run(script,
config, n_processes)` answers as `processes.run` does, with every process's output. A scenario that fails or
does not answer in time fails its test with every process's output, and its cluster is stopped by the process
groups' pids and started again at the next request, so the next test meets healthy workers. Lifecycle tests
(kills, signals, restarts, the start of a process measured) keep their own processes (`processes.start`).
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time

from flaxstate_testing import processes
from flaxstate_testing.workers import serve

START_TIMEOUT = 120.0
"""Seconds for a cluster's workers to start, join and import (a loaded machine's first compilation included)."""

GRACE = 3.0
"""Seconds the other workers get to answer once one has failed, before all are stopped (what they printed is in
their stderr, shown either way)."""


class Cluster:
    """`n_processes` serving workers (`workers/serve.py`), one CPU device each, started at the first request.

    Args:
        n_processes: how many processes join.
    """

    def __init__(self, n_processes: int) -> None:
        self.n_processes = n_processes
        self._workers: list[subprocess.Popen] = []
        self._logs: list[tempfile._TemporaryFileWrapper] = []
        self._answers: queue.Queue[tuple[int, str | None]] = queue.Queue()
        self.starts = 0
        """How many times its workers were started (once, unless a scenario failed)."""

    def _start(self) -> None:
        port = processes.free_port()
        self._answers = queue.Queue()
        self._logs = [tempfile.TemporaryFile("w+") for _ in range(self.n_processes)]
        env = processes.worker_env()
        env["JAX_COORDINATOR_BIND_ADDRESS"] = f"127.0.0.1:{port}"  # JAX's default binds every interface
        for index, log in enumerate(self._logs):
            config = {"process_id": index, "n_processes": self.n_processes, "port": port}
            worker = subprocess.Popen(
                [sys.executable, "-m", "flaxstate_testing.workers.serve", json.dumps(config)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
            self._workers.append(worker)
            threading.Thread(target=self._read, args=(index, worker, self._answers), daemon=True).start()
        self.starts += 1
        lines = self._collect(time.monotonic() + START_TIMEOUT)
        if any(line != serve.READY for line in lines):
            self._fail("did not start", [""] * self.n_processes, lines)

    @staticmethod
    def _read(index: int, worker: subprocess.Popen, answers: queue.Queue) -> None:
        for line in worker.stdout:
            answers.put((index, line.rstrip("\n")))
        answers.put((index, None))

    def _collect(self, deadline: float) -> list[str | None]:
        """One line from each worker (None for one that ended or did not answer by the deadline)."""
        lines: dict[int, str | None] = {}
        while len(lines) < self.n_processes:
            try:
                index, line = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            lines.setdefault(index, line)
            failed = line is None or (line != serve.READY and not json.loads(line)["ok"])
            if failed:
                deadline = min(deadline, time.monotonic() + GRACE)
        return [lines.get(index) for index in range(self.n_processes)]

    def run(self, script: str, config: dict, timeout: float = 180) -> list[str]:
        """Runs a worker script on every process of the cluster; returns each process's output.

        Args:
            script: the name of a module of `flaxstate_testing.workers`.
            config: what the script's `setup()` returns, less the process's id and count.
            timeout: seconds for every process to answer.

        Raises:
            AssertionError: a process failed or did not answer in time (the cluster is then stopped, with every
                process's output in the message).
        """
        if not self._workers:
            self._start()
        request = {"script": script.removesuffix(".py"), "config": config, "environment": processes.worker_env()}
        request = json.dumps(request) + "\n"
        for worker in self._workers:
            try:
                worker.stdin.write(request)
                worker.stdin.flush()
            except (BrokenPipeError, OSError):
                pass  # it ended: it answers None
        lines = self._collect(time.monotonic() + timeout)
        answers = [json.loads(line) if line else None for line in lines]
        if all(answer and answer["ok"] for answer in answers):
            return [answer["output"] for answer in answers]
        outputs = [answer["output"] if answer else "" for answer in answers]
        self._fail(f"{script} {json.dumps(config)[:300]} failed or did not answer in {timeout} s", outputs, lines)

    def _fail(self, what: str, outputs: list[str], lines: list[str | None]) -> None:
        logs = self._read_logs()
        self.close()
        report = "\n".join(
            f"--- process {index} ({'no answer' if line is None else 'answered'}) ---\n{output[-4000:]}\n"
            f"--- process {index}'s stderr ---\n{log[-3000:]}"
            for index, (output, line, log) in enumerate(zip(outputs, lines, logs, strict=True))
        )
        raise AssertionError(f"the shared cluster of {self.n_processes} processes: {what}:\n{report}")

    def _read_logs(self) -> list[str]:
        texts = []
        for log in self._logs:
            log.seek(0)
            texts.append(log.read())
        return texts or [""] * self.n_processes

    def close(self) -> None:
        """Stops the workers (their process groups, by pid) and reaps them."""
        for worker in self._workers:
            processes.kill(worker)
        for worker in self._workers:
            worker.wait(timeout=30)
            for stream in (worker.stdin, worker.stdout):
                with contextlib.suppress(OSError):
                    stream.close()
        for log in self._logs:
            log.close()
        self._workers, self._logs = [], []


_CLUSTERS: dict[int, Cluster] = {}
"""The session's clusters, by process count."""


def run(script: str, config: dict, n_processes: int = 2, timeout: float = 180) -> list[str]:
    """`Cluster.run` on the session's cluster of `n_processes` processes (started at its first request)."""
    return _CLUSTERS.setdefault(n_processes, Cluster(n_processes)).run(script, config, timeout)


def close() -> None:
    """Stops the session's clusters."""
    for cluster in _CLUSTERS.values():
        cluster.close()
