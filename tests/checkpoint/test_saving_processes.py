"""A store's one background save: its failure raised once naming the step, and steps set aside and pruned.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of saving are in test_saving.py.
"""

import os
import queue
import signal
import threading
import time

import numpy as np

from flaxstate.checkpoint import saving


def test_ctrl_c_at_any_moment_of_a_wait_raises_keyboard_interrupt_and_the_save_goes_on():
    """A real SIGINT at moments around a background save's end: the wait raises KeyboardInterrupt or returns.

    Never another error (an Event's wait failed once in a notebook with `release unlocked lock`, the Stop pressed
    as the save ended), and a wait after an interrupt returns once the save has ended, its work done. The signal
    comes from a thread started once, asked through a `SimpleQueue`: this thread starts no thread (whose start
    waits on an Event) while a signal may come.
    """
    random = np.random.default_rng(0)
    requests, sent = queue.SimpleQueue(), []

    def signaller():
        while (delay := requests.get()) is not None:
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGINT)
            sent.append(delay)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    thread = threading.Thread(target=signaller)
    thread.start()
    outcomes = []
    try:
        for index in range(200):
            done = []
            save = saving.BackgroundSave(1, lambda done=done: (time.sleep(0.002), done.append(True)))
            requests.put(random.uniform(0, 0.004))
            try:
                try:
                    save.join()
                    outcomes.append("returned")
                except KeyboardInterrupt:
                    outcomes.append("interrupted")
                    save.join()
                    assert done == [True]
                while len(sent) <= index:  # the signal may come here instead, after the wait
                    time.sleep(0.0005)
                time.sleep(0.005)
            except KeyboardInterrupt:
                while len(sent) <= index:
                    time.sleep(0.0005)
            save.join()
            assert done == [True]
    finally:
        requests.put(None)
        thread.join()
        signal.signal(signal.SIGINT, previous)
    assert "interrupted" in outcomes and "returned" in outcomes, outcomes
