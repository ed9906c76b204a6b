"""Sharded training over 2 gloo processes (one CPU device each): the LM example's model, FSDP and tensor-parallel.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of sharded_loop are in test_sharded_loop_joined.py.

One worker run trains every layout in turn (`flaxstate_testing/workers/sharded.py`), so the processes join
once; the one-device runs they are compared with train here, in the test's own process. kill -9 and SIGTERM
(preemption) runs start their own workers, and resume to end bit for bit as a straight FSDP run.
"""

import os
import re
import signal
import time

import pytest
from flaxstate_testing import cluster, processes
from test_sharded_loop_joined import FSDP, LONG, MODEL, N, assert_bit_equal_checkpoints, straight_runs

import flaxstate as fs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The straight runs the resumes here end equal to: `test_sharded_loop_joined.py`'s, made once a session."""
    return straight_runs(tmp_path_factory.getbasetemp())


def test_kill_9_during_a_sharded_run_then_resume_ends_bit_for_bit_as_the_straight_run(runs, tmp_path):
    root, _ = runs
    directory = str(tmp_path / "killed")
    stalled = {"mesh": FSDP, "dir": directory, "steps": N, "stall_at": 4}
    port = processes.free_port()
    workers = [processes.start("sharded.py", {"model": MODEL, "phases": [stalled]}, i, 2, port) for i in range(2)]
    watched = [processes.Watched(worker) for worker in workers]
    try:
        for worker in watched:
            worker.wait_for("stalled", timeout=120)
        time.sleep(0.5)  # step 2's save in flight or done; steps 3-4 dispatched, or not
    finally:
        for worker in workers:
            processes.kill(worker)
            worker.wait(timeout=30)
    assert all(worker.returncode == -signal.SIGKILL for worker in workers)
    saved = sorted(int(p.name) for p in (tmp_path / "killed").iterdir() if p.name.isdigit())
    print("after kill -9:", saved)
    resumed = dict(stalled, stall_at=None)
    cluster.run("sharded", {"model": MODEL, "phases": [resumed]}, n_processes=2, timeout=180)
    assert_bit_equal_checkpoints(directory, root / "fsdp", N)


def test_sigterm_to_one_process_of_an_fsdp_run_stops_both_at_one_step_then_resume_ends_bit_for_bit(runs, tmp_path):
    root, _ = runs
    directory = str(tmp_path / "preempted")
    slow = {"mesh": FSDP, "dir": directory, "steps": LONG, "data_sleep": 0.3}
    with processes.watched("sharded.py", {"model": MODEL, "phases": [slow]}, 2) as workers:
        for worker in workers:
            worker.wait_for("record 4", timeout=120)
        os.kill(workers[1].process.pid, signal.SIGTERM)  # process 1 only: process 0 hears of it from JAX
        codes = [worker.finish(timeout=90) for worker in workers]
    outputs = "\n".join(worker.output for worker in workers)
    assert codes == [0, 0], outputs
    stopped = [re.findall(r"^record (\d+) preempted$", worker.output, flags=re.MULTILINE) for worker in workers]
    assert stopped[0] == stopped[1] and len(stopped[0]) == 1, outputs
    stopped_at = int(stopped[0][0])
    print("preempted at", stopped_at)
    assert 4 <= stopped_at < LONG and stopped_at % MODEL["steps_per_dispatch"] == 0
    assert fs.CheckpointFileReader(directory).read(None).step == stopped_at  # saved whatever the interval
    cluster.run("sharded", {"model": MODEL, "phases": [dict(slow, data_sleep=0.0)]}, n_processes=2, timeout=180)
    assert_bit_equal_checkpoints(directory, root / "fsdp-long", LONG)
