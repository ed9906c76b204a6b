"""The watchdog and the signals of issue 28, on real worker processes with real signals and hard timeouts.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of watchdog are in test_watchdog.py.

`workers/resume.py` trains with checkpoints (`for c in loop: writer(c)`) and
prints each record; a stuck data reader, a stopped peer (`SIGSTOP`), a slow
process and `SIGUSR1` are all real. Each restart must end bit-equal to a
run that was never stopped.
"""

import os
import re
import signal
import time

import pytest
from flaxstate_testing import cluster, processes
from flaxstate_testing.checkpoints import assert_equal_files, saved_steps

from flaxstate.training import watchdog

CONFIG = {"n_steps": 60, "every": 10, "data": "list", "optimizer": "sgd", "keep": 2}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The parameters of a run never stopped, by process count (made once a module)."""
    made = {}

    def make(n_processes=1):
        if n_processes not in made:
            root = tmp_path_factory.mktemp("reference")
            config = dict(CONFIG, output_dir=str(root / "run"), out=str(root / "out.npz"), resume=False)
            cluster.run("resume", config, n_processes=n_processes)
            made[n_processes] = root / "out.npz"
        return made[n_processes]

    return make


def test_a_stuck_data_reader_ends_the_process_with_the_restart_status_naming_the_wait(tmp_path, reference):
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), resume=False)
    # The 3 s from the first record on: under load (CI's two lanes beside other tests) the first compilations
    # took longer than 3 s, and the watchdog fired there, before any record.
    worker = processes.Watched(processes.start("resume", dict(config, block_after=25, hang_timeout_from_record=3)))
    assert worker.finish(timeout=120) == watchdog.EXIT_STATUS == 75
    output = worker.output
    assert "record 20" in output and "record 30" not in output
    waited = re.search(r"flaxstate watchdog: no progress for (\d+) s at step 25: waiting for the data", output)
    assert waited and int(waited[1]) >= 3, output  # a loaded host's watchdog looks a little late
    assert "stuck_reader" in output and "Thread 0x" in output  # the generator's frame, in every thread's stack
    assert "exits with status 75" in output
    assert saved_steps(run_dir)[-1] == 20
    restarted = tmp_path / "b.npz"
    output = cluster.run("resume", dict(config, resume=True, out=str(restarted)), n_processes=1)[0]
    assert "start 20" in output
    assert_equal_files(restarted, reference())


def test_a_stopped_peer_ends_the_other_process_and_both_resume_bit_equal(tmp_path, reference):
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), resume=False, data_sleep=0.05)
    # The 5 s from the first record on: two processes compiling beside a CPU burner took longer, and fired there.
    with processes.watched("resume", dict(config, hang_timeout_from_record=5), 2) as workers:
        for worker in workers:  # record 20's save waited for step 10's: a step is saved before the stop
            worker.wait_for("record 20", timeout=120)
        os.kill(workers[1].process.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        assert workers[0].finish(timeout=90) == watchdog.EXIT_STATUS
        assert time.monotonic() - stopped < 5 + 20
        output = workers[0].output
        assert "flaxstate watchdog: process 0: no progress for 5 s at step" in output
        assert "Thread 0x" in output and "exits with status 75" in output
    steps = saved_steps(run_dir)
    restarted = tmp_path / "b.npz"
    outputs = cluster.run("resume", dict(config, resume=True, data_sleep=0, out=str(restarted)), n_processes=2)
    assert all(f"start {steps[-1]}" in output for output in outputs)
    assert_equal_files(restarted, reference(2))


def test_slow_but_progressing_steps_never_fire_and_an_interactive_session_is_only_told(tmp_path):
    config = dict(CONFIG, n_steps=20, out=str(tmp_path / "a.npz"), resume=False)
    # "auto" with a floor of 2 s: a record's segment takes 3 s (0.3 s a batch) but progresses.
    slow = dict(config, output_dir=str(tmp_path / "slow"), data_sleep=0.3, floor=2)
    # Interactive: a 3 s stall with a 1 s timeout is reported, and the run goes on to its end.
    told = dict(
        config, output_dir=str(tmp_path / "told"), block_after=12, block_seconds=3, hang_timeout=1, interactive=True
    )
    # Off: the same stall says nothing.
    off = dict(told, output_dir=str(tmp_path / "off"), hang_timeout=None, interactive=False)
    # Three processes at once: most of each run is a wait.
    outputs = processes.wait_all([processes.start("resume", each) for each in (slow, told, off)], timeout=240)
    assert "record 20" in outputs[0] and "watchdog" not in outputs[0]
    assert "no progress for 1 s at step 12: waiting for the data" in outputs[1]
    assert "Interactive session: the process is left running" in outputs[1] and "record 20" in outputs[1]
    assert "record 20" in outputs[2] and "watchdog" not in outputs[2]


REQUESTED = dict(CONFIG, resume=False, data_sleep=0.05, every_seconds=3600, keep=5)
"""A run that saves only what is asked (SIGUSR1) and its last record, slow enough for a signal to land."""


def test_sigusr1_to_one_of_two_processes_makes_both_save_the_same_step_and_train_on(tmp_path):
    run_dir = tmp_path / "run"
    config = dict(REQUESTED, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), slow_process=1, logger=True)
    with processes.watched("resume", config, 2) as workers:
        for worker in workers:
            worker.wait_for("record 20", timeout=180)
        os.kill(workers[1].process.pid, signal.SIGUSR1)
        for worker in workers:
            assert worker.finish(timeout=240) == 0
    requested = [[line.split()[1] for line in w.output.splitlines() if line.endswith("requested")] for w in workers]
    assert len(requested[0]) == 1 and requested[0] == requested[1]
    assert saved_steps(run_dir) == [int(requested[0][0]), 60]
    assert "record 60" in workers[0].output and "record 60" in workers[1].output
    # Process 1's data is 4x slower: the records name it (process 0's logger prints).
    assert "process 1 waited" in workers[0].output and "for its data; the others" in workers[0].output


def test_sigusr1_to_a_single_process_saves_the_next_record(tmp_path):
    run_dir = tmp_path / "run"
    config = dict(REQUESTED, output_dir=str(run_dir), out=str(tmp_path / "a.npz"))
    worker = processes.Watched(processes.start("resume", config))
    worker.wait_for("record 20", timeout=120)
    worker.process.send_signal(signal.SIGUSR1)
    assert worker.finish(timeout=120) == 0
    requested = [line.split()[1] for line in worker.output.splitlines() if line.endswith("requested")]
    assert len(requested) == 1 and saved_steps(run_dir) == [int(requested[0]), 60]


def test_a_resume_s_catch_up_and_each_of_k_batches_are_progress(tmp_path, reference):
    """A resume draws 20 batches to catch up (5 s) and a dispatch draws 10 (2.5 s); neither is a hang of 1.5 s."""
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), per_dispatch=10, out=str(tmp_path / "a.npz"))
    processes.run("resume", dict(config, n_steps=20, resume=False))
    slow = dict(config, resume=True, data_sleep=0.25, hang_timeout=1.5, n_steps=30)
    output = processes.run("resume", slow, timeout=240)[0]
    assert "start 20" in output and "record 30" in output and "watchdog" not in output, output[-3000:]


def test_a_pdb_prompt_in_the_data_reader_is_left_alone(tmp_path):
    config = dict(CONFIG, n_steps=20, output_dir=str(tmp_path / "run"), out=str(tmp_path / "a.npz"), resume=False)
    worker = processes.Watched(processes.start("resume", dict(config, pdb_after=12, pdb_seconds=4, hang_timeout=1)))
    assert worker.finish(timeout=120) == 0, worker.output[-3000:]
    assert "at the pdb prompt" in worker.output and "(Pdb)" in worker.output
    assert "record 20" in worker.output and "watchdog" not in worker.output


UNFINISHED_AT_EXIT = """
import atexit, threading
# Registered before flaxstate's import, so it runs after flaxstate's own exit hooks, just before the teardown.
atexit.register(lambda: print("threads at teardown:", sorted(t.name for t in threading.enumerate())))
import optax, flaxstate as fs
from flaxstate_testing import toy
model = toy.MLP()
task = fs.TrainTask(apply=model.apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=toy.batches(4, 8))
kept = fs.TrainLoop(model.init, task, 0, n_steps=2, n_steps_per_checkpoint=2, stdout=False)
list(kept)  # a finished loop keeps its watchdog for a next run() (a notebook's habit)
left = iter(fs.TrainLoop(model.init, task, 0, n_steps=4, n_steps_per_checkpoint=2, stdout=False))
next(left)  # and one left unfinished
"""


def test_no_watchdog_thread_is_left_when_the_interpreter_tears_down():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", UNFINISHED_AT_EXIT],
        env=processes.worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result
    assert "threads at teardown: ['MainThread']" in result.stdout, result.stdout + result.stderr
