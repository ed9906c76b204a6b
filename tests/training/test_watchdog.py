"""The watchdog and the signals of issue 28, on real worker processes with real signals and hard timeouts.

`workers/resume.py` trains with checkpoints (`for c in loop: writer(c)`) and
prints each record; a stuck data reader, a stopped peer (`SIGSTOP`), a slow
process and `SIGUSR1` are all real. Each restart must end bit-equal to a
run that was never stopped.
"""

import gc
import os
import re
import signal
import threading
import time

import numpy as np
import pytest
from flaxstate_testing import cluster, processes
from flaxstate_testing.checkpoints import assert_equal_files, saved_steps
from flaxstate_testing.loops import make_loop

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


def test_each_phase_carries_its_allowance_and_its_message_is_only_text():
    allowances = {phase.name: phase.floor_seconds for phase in watchdog.Phase}
    slow, normal = watchdog.SLOW_FLOOR_SECONDS, watchdog.FLOOR_SECONDS
    assert allowances == {
        "STARTING": normal,
        "RESTORING": slow,
        "COMPILING_STATE": slow,
        "COMPILING_ONE_STEP": slow,
        "COMPILING_UPDATE": slow,
        "WAITING_FOR_DATA": normal,
        "DISPATCHING": normal,
        "WAITING_FOR_DEVICES": normal,
        "AGREEING_ON_RECORD": normal,
        "WAITING_FOR_SAVES": normal,
    }
    assert (slow, normal) == (3600.0, 600.0)
    dog = watchdog.Watchdog("auto", exit_process=False)
    assert dog.limit(watchdog.Phase.COMPILING_UPDATE) == 3600.0 and dog.limit(watchdog.Phase.DISPATCHING) == 600.0
    assert watchdog.Watchdog(5, exit_process=False).limit(watchdog.Phase.COMPILING_UPDATE) == 5.0
    assert watchdog.Watchdog(None).limit(watchdog.Phase.DISPATCHING) == float("inf")


def test_hang_timeout_takes_numpy_numbers_and_refuses_what_is_no_number():
    assert watchdog.check_timeout(np.int64(600)) == 600.0 and watchdog.check_timeout(np.float32(1.5)) == 1.5
    assert watchdog.check_timeout("auto") == "auto" and watchdog.check_timeout(None) is None
    for bad in ("600", 0, -1, float("nan"), float("inf"), True, [600]):
        with pytest.raises(ValueError, match="hang_timeout must be a positive number of seconds"):
            watchdog.check_timeout(bad)


def fires(dog: watchdog.Watchdog, seconds: float, every: float | None) -> bool:
    """Whether `dog` fires within `seconds` of a watched block, told of progress every `every` seconds."""
    with dog.watching(watchdog.Phase.WAITING_FOR_DATA):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(every or seconds)
            if every is not None:
                dog.beat()
    dog.close()
    return dog.fired


def test_beats_keep_it_quiet_and_silence_fires_naming_the_phase(capfd):
    assert not fires(watchdog.Watchdog(0.8, exit_process=False), 2.5, every=0.1)
    assert fires(watchdog.Watchdog(0.8, exit_process=False), 2.5, every=None)
    assert "no progress for 1 s at step 0: waiting for the data" in capfd.readouterr().err


def test_a_debugger_holding_a_prompt_in_any_thread_is_a_person_at_work():
    import bdb
    import threading

    dog = watchdog.Watchdog(0.8, exit_process=False)
    stopped, release = threading.Event(), threading.Event()

    class Prompt(bdb.Bdb):  # a debugger stopped at a line, waiting for its person (as pdb's prompt does)
        def user_line(self, frame):
            stopped.set()
            release.wait(10)
            self.set_continue()

    def reader():
        Prompt().set_trace()
        return 1

    with dog.watching(watchdog.Phase.WAITING_FOR_DATA):
        thread = threading.Thread(target=reader)
        thread.start()
        assert stopped.wait(10) and watchdog.debugger_attached()
        time.sleep(2.5)  # three timeouts at the prompt
        fired_at_the_prompt = dog.fired
        release.set()
        thread.join(10)
        assert not watchdog.debugger_attached()
        time.sleep(2.5)  # no progress and no debugger: it fires
    dog.close()
    assert not fired_at_the_prompt and dog.fired


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


def test_run_called_once_a_cell_keeps_one_watchdog_thread_which_a_dropped_loop_stops():
    before = set(threading.enumerate())
    loop = make_loop(n_steps=2, every=2, hang_timeout=60)
    threads = set()
    for n_steps in (2, 4, 6):  # three cells, each ending its run
        for _ in loop.run(n_steps):
            threads |= {t for t in threading.enumerate() if t.name == "flaxstate-watchdog" and t not in before}
    assert loop.step == 6 and len(threads) == 1, threads  # one across runs (each end used to stop it)
    (thread,) = threads
    assert thread.is_alive()
    del loop
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_close_returns_once_the_thread_has_ended_and_holds_no_device_arrays():
    # A daemon thread that asks the devices while the interpreter tears down is killed inside jaxlib ("terminate
    # called after throwing an instance of ..." / "FATAL: exception not rethrown", status -6): close waits for it.
    for _ in range(5):
        dog = watchdog.Watchdog(60)
        with dog.watching():
            dog.dispatched(np.zeros(3))
            (thread,) = [t for t in threading.enumerate() if t.name == "flaxstate-watchdog" and t.is_alive()]
        dog.close()
        assert not thread.is_alive()
        assert dog._devices_done() == 0  # noqa: SLF001 - its outputs dropped


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


def test_a_ctrl_c_while_the_thread_starts_leaves_a_watchdog_that_closes_and_starts_again(monkeypatch):
    # A notebook's stop button landed in `Thread.start`; close (at the failed construction) then joined a thread
    # never started: "RuntimeError: cannot join thread before it is started" instead of the KeyboardInterrupt.
    started = threading.Thread.start

    def interrupted(thread):
        if thread.name == "flaxstate-watchdog":
            raise KeyboardInterrupt
        started(thread)

    dog = watchdog.Watchdog(60)
    monkeypatch.setattr(threading.Thread, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with dog.watching():
            pass
    dog.close()
    monkeypatch.setattr(threading.Thread, "start", started)
    with dog.watching():
        assert any(t.name == "flaxstate-watchdog" and t.is_alive() for t in threading.enumerate())
    dog.close()
