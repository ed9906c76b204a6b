"""The watchdog and the signals of issue 28, on real worker processes with real signals and hard timeouts.

`workers/resume.py` trains with checkpoints (`for c in loop: writer(c)`) and
prints each record; a stuck data reader, a stopped peer (`SIGSTOP`), a slow
process and `SIGUSR1` are all real. Each restart must end bit-equal to a
run that was never stopped.
"""

import gc
import threading
import time

import numpy as np
import pytest
from flaxstate_testing.loops import make_loop

from flaxstate.training import watchdog


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
