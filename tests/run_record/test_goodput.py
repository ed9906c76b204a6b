"""The goodput ledger of real runs: `kill -9` and restart, SIGTERM and restart, two gloo processes.

Each run is a worker process (`workers/resume.py`: `for c in loop: writer(c)`)
with a hard timeout; the ledger is read back through `flaxstate goodput DIR --json`.
"""

import pytest

from flaxstate.run_record import goodput


def assert_adds_up(account):
    parts = account["productive"] + sum(account[name] for name in goodput.BUCKETS)
    assert parts == pytest.approx(account["wall_time"], rel=1e-6, abs=1e-6)
    assert all(account[name] >= 0 for name in goodput.BUCKETS if name != "outside_loop")
    assert account["outside_loop"] > -0.05 * account["wall_time"]
    assert 0 < account["goodput"] <= 1


def test_saves_running_in_the_background_are_a_bucket_of_their_own_that_adds_up_with_the_others():
    # Records of 10 steps at 1 s a step, but 1.5 s a step while the save of step 40 runs (its call blocked 0.2 s,
    # then it ran 30 s in the background): the 2 x 5 s beyond the clean step time are the save's drag.
    def record(at, step):
        fields = {"compile": 0.0, "data_wait": 0.0, "idle": 0.0, "outside": 0.0, "run_id": "r"}
        return {"event": "record", "time": at, "step": step, "steps": 10, "elapsed": at - previous[0], **fields}

    events = [{"event": "session", "time": 0.0, "pid": 1, "startup": 1.0, "restored_step": None, "run_id": "r"}]
    previous, at = [1.0], 1.0
    for step, seconds in ((10, 10), (20, 10), (30, 10), (40, 10), (50, 15), (60, 15), (70, 10), (80, 10)):
        at += seconds
        events.append(record(at, step))
        previous[0] = at
        if step == 40:
            at += 0.2
            events.append({"event": "save", "time": at, "step": 40, "blocking": 0.2, "run_id": "r"})
            previous[0] = at
    events.append({"event": "completed", "time": at, "step": 40, "seconds": 30.2, "run_id": "r"})
    events.append({"event": "end", "time": at, "step": 80, "preempted": False, "run_id": "r"})
    (account,) = goodput.report(events)["sessions"]
    assert account["save_drag"] == pytest.approx(10.0) and account["checkpoint"] == pytest.approx(0.2)
    assert account["productive"] == pytest.approx(90.0 - 10.0)  # the steps' time at the clean step time
    assert_adds_up(account)
    assert "save drag" in goodput.format_report(goodput.report(events))


def test_a_save_that_ran_only_while_the_caller_held_a_record_drags_no_step():
    # Records of 10 steps at 1 s a step. After the record of step 40 the caller evaluates for 20 s; the save it
    # started ran 5 s of that and was done before the loop went on. The next record is slower (12 s, for a reason
    # of its own): the save overlapped none of its training, so no drag (the gap is outside the loop).
    fields = {"compile": 0.0, "data_wait": 0.0, "idle": 0.0, "outside": 0.0, "run_id": "r"}
    events = [{"event": "session", "time": 0.0, "pid": 1, "startup": 1.0, "restored_step": None, "run_id": "r"}]
    at = 1.0
    for step, seconds in ((10, 10), (20, 10), (30, 10), (40, 10), (50, 12), (60, 10)):
        at += seconds
        events.append({"event": "record", "time": at, "step": step, "steps": 10, "elapsed": seconds, **fields})
        if step == 40:
            events.append({"event": "save", "time": at + 0.2, "step": 40, "blocking": 0.2, "run_id": "r"})
            events.append({"event": "completed", "time": at + 5.2, "step": 40, "seconds": 5.0, "run_id": "r"})
            at += 20.0
    events.append({"event": "end", "time": at, "step": 60, "preempted": False, "run_id": "r"})
    (account,) = goodput.report(events)["sessions"]
    assert account["save_drag"] == 0.0 and account["checkpoint"] == pytest.approx(0.2)
    assert account["productive"] == pytest.approx(62.0)
    assert account["outside_loop"] == pytest.approx(20.0 - 0.2)
    assert_adds_up(account)
