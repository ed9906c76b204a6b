import dataclasses
import json
import logging
import math
import threading

import pytest
from flaxstate_testing.checkpoints import patch_async_save, records, saved_steps

import flaxstate as fs
from flaxstate.checkpoint import schedule
from flaxstate.run_record import cadence, goodput, ledger


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture(scope="module")
def recs():
    return records(n_steps=16, every=2)  # steps 2, 4, ..., 16 (final)


def held_saves(monkeypatch):
    """Holds every orbax save in its thread until the returned event is set; `outcomes` says, for each write held,
    whether the event released it (True) or a minute passed (False: the test's own calls waited for it)."""
    release, outcomes = threading.Event(), []
    patch_async_save(monkeypatch, lambda: outcomes.append(release.wait(timeout=60)))
    return release, outcomes


@pytest.mark.parametrize("every", ["continuous", fs.Continuous()], ids=["keyword", "policy"])
def test_continuous_saves_pass_records_over_while_a_save_runs_and_never_wait_for_it(tmp_path, monkeypatch, recs, every):
    release, outcomes = held_saves(monkeypatch)
    writer = fs.CheckpointFileWriter(tmp_path, keep=10, every=every)
    for record in recs[:5]:  # steps 2-10: the first is saved, and held; the next four come while it runs
        writer(record)
    release.set()
    writer.wait()
    assert outcomes and all(outcomes)  # released by the test: no call waited for the held save
    assert saved_steps(tmp_path) == [2]
    writer(recs[5])  # no save in flight: saved
    writer(recs[6])  # in flight or not, it is never waited for
    writer(recs[7])  # the final record: always saved, and on disk when the call returns
    steps = saved_steps(tmp_path)
    assert steps[:2] == [2, 12] and steps[-1] == 16 and set(steps) <= {2, 12, 14, 16}, steps
    writer.close()


@pytest.mark.parametrize(
    "when",
    [{"every": "continuous", "min_seconds": 30}, {"every": fs.Continuous(min_seconds=30)}],
    ids=["keyword", "policy"],
)
def test_continuous_saves_keep_min_seconds_between_their_starts(tmp_path, recs, when):
    clock = Clock()
    with fs.CheckpointFileWriter(tmp_path, keep=10, clock=clock, **when) as writer:
        writer(recs[0])  # the first record: saved
        writer.wait()
        clock.now += 29
        writer(recs[1])  # no save in flight, but 29 s since the last one started
        clock.now += 1
        writer(recs[2])  # 30 s: saved
        writer.wait()
        assert saved_steps(tmp_path) == [2, 6]
        requested = dataclasses.replace(recs[3], requested=True)
        writer(requested)  # asked for (SIGUSR1): saved whatever the interval
    assert saved_steps(tmp_path) == [2, 6, 8]


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"every": "sometimes"},
            "a due(context) method: fs.SavePolicy) or None (every record), got 'sometimes'",
        ),
        ({"every": "continuous", "every_seconds": 60}, "both set when to save. Give one"),
        ({"min_seconds": 5}, "min_seconds=5 without every="),
        ({"every": "continuous", "mtbf": 3600}, "mtbf=3600 with every='continuous'"),
        ({"every": "auto", "mtbf": -1}, "mtbf must be a positive number of seconds or None, got -1"),
        ({"every": "auto", "min_seconds": float("nan")}, "min_seconds must be a positive number"),
    ],
)
def test_a_bad_schedule_is_refused_before_the_directory_is_touched(tmp_path, given, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fs.CheckpointFileWriter(tmp_path / "run", **given)
    assert not (tmp_path / "run").exists()


def drive(sched, clock, record, seconds, steps=10):
    """One record after `seconds` of stepping; returns whether the schedule saves it and the change it logs."""
    clock.now += seconds
    sched.note(
        dataclasses.replace(record, elapsed_time=seconds, compile_time=0.0, idle_time=0.0, n_completed_steps=steps)
    )
    return sched.due(in_flight=False)


def test_auto_follows_a_changed_save_cost_and_failure_rate(recs):
    # The ledger's failures and an injected clock drive the interval: a save that costs 2 s and a prior of an
    # hour between failures give sqrt(2 x 2 x (3600 + running)); a save that costs 8 s doubles it; failures
    # seen in the ledger shorten it.
    clock, failures = Clock(), [None]
    sched = schedule.SaveSchedule(fs.AutoInterval(mtbf=3600.0), clock, lambda: failures[0])
    record = recs[0]
    assert drive(sched, clock, record, 10.0) == (True, None)  # no cost known yet: the first record is saved
    sched.started(2, clock.now, blocking=2.0)
    sched.completed((2, 2.0))  # it ran 2 s, all of them blocking: no background part
    due, change = drive(sched, clock, record, 10.0)
    expected = math.sqrt(2 * 2.0 * (3600.0 + 20.0))
    assert not due and change.interval == pytest.approx(expected) and change.cost == pytest.approx(2.0)
    assert change.expected_loss == pytest.approx(expected / 2 + 2.0)
    assert "saving every" in change.line("W") and "3620 s between failures" in change.line("W")
    assert drive(sched, clock, record, 10.0) == (False, None)  # the same interval is not logged again
    clock.now += expected  # the interval passed
    due, _ = drive(sched, clock, record, 1.0)
    assert due
    for _ in range(schedule.RECENT_SAVES):  # saves become 8 s each
        sched.started(4, clock.now, blocking=8.0)
        sched.completed((4, 8.0))
        drive(sched, clock, record, 1.0)
    slower = sched.interval
    running = clock.now - 1000.0
    assert slower == pytest.approx(math.sqrt(2 * 8.0 * (3600.0 + running)), rel=1e-6)
    failures[0] = fs.RunHistory(9, 1000.0)  # the ledger: 9 failures in 1000 s before this session
    _, change = drive(sched, clock, record, 1.0)
    mean_time = (1000.0 + running + 1.0 + 3600.0) / 10
    assert change.failures == 9 and change.mtbf == pytest.approx(mean_time)
    assert sched.interval == pytest.approx(math.sqrt(2 * 8.0 * mean_time)) and sched.interval < slower


def test_auto_counts_a_save_s_drag_and_keeps_to_its_bounds(recs):
    clock = Clock()
    sched = schedule.SaveSchedule(fs.AutoInterval(5.0, 100.0), clock)
    record = recs[0]
    for _ in range(4):  # clean: 1 s a step
        drive(sched, clock, record, 10.0)
    sched.started(2, clock.now, blocking=0.5)
    for _ in range(2):  # a save in flight: 1.5 s a step
        drive(sched, clock, record, 15.0)
    sched.completed((2, 30.0))
    drive(sched, clock, record, 10.0)
    assert sched.save_cost() == pytest.approx(0.5 + 10.0)  # blocking plus 2 x 5 s of drag
    assert sched.interval == pytest.approx(math.sqrt(2 * 10.5 * (100.0 + clock.now - 1000.0) / 1))
    tiny = schedule.SaveSchedule(fs.AutoInterval(5.0, 1.0), clock)  # failing every second: the least is 5 s
    tiny.started(2, clock.now, 0.01)
    tiny.completed((2, 0.01))
    drive(tiny, clock, record, 1.0)
    assert tiny.interval == 5.0
    rare = schedule.SaveSchedule(fs.AutoInterval(mtbf=1e9), clock)  # never failing: an hour at most
    rare.started(2, clock.now, 60.0)
    rare.completed((2, 60.0))
    _, change = drive(rare, clock, record, 1.0)
    assert rare.interval == cadence.MAX_SECONDS and "bounded" in change.line("W")


def test_auto_counts_no_drag_for_a_save_that_ran_only_while_the_caller_held_a_record(recs):
    # Records of 1 s a step. The caller evaluates for 20 s after a record, and the save it started runs 5 s of
    # that. The next record is slower (12 s) for a reason of its own: none of its training overlapped the save,
    # so the save costs its blocking alone.
    clock = Clock()
    sched = schedule.SaveSchedule(fs.AutoInterval(mtbf=100.0), clock)
    record = recs[0]
    for _ in range(4):
        drive(sched, clock, record, 10.0)
    sched.started(2, clock.now, blocking=0.5)
    sched.completed((2, 5.0))
    clock.now += 20.0
    drive(sched, clock, record, 12.0)
    drive(sched, clock, record, 10.0)
    assert sched.save_cost() == pytest.approx(0.5)


def ledger_lines(path, run_id):
    """A ledger of two sessions of `run_id`: one killed (no end) after 600 s, one that ended after 400 s."""

    def session(at, restored):
        return {"event": "session", "time": at, "pid": 1, "startup": 1.0, "restored_step": restored, "run_id": run_id}

    def record(at, step):
        fields = {"compile": 0.0, "data_wait": 0.0, "idle": 0.0, "outside": 0.0, "run_id": run_id}
        return {"event": "record", "time": at, "step": step, "steps": 2, "elapsed": 1.0, **fields}

    events = [session(0.0, None), record(600.0, 2), session(700.0, 2), record(1100.0, 4)]
    events.append({"event": "end", "time": 1100.0, "step": 4, "preempted": False, "run_id": run_id})
    path.write_text("".join(json.dumps(event) + "\n" for event in events))


def test_auto_reads_the_failures_in_the_run_s_ledger_and_logs_each_change(tmp_path, recs, caplog):
    # A run directory whose ledger holds a killed session and one that ended: the writer of a resumed session
    # sees one failure in 1000 s of running, and so does a local tier's writer in the same chain, which keeps no
    # ledger of its own, given the persistent writer's history.
    run_id = recs[0].run_id
    (tmp_path / "run").mkdir()
    ledger_lines(tmp_path / "run" / ledger.FILENAME, run_id)
    resumed = dataclasses.replace(recs[2].session, restored_step=4)
    clock = Clock()
    writer = fs.CheckpointFileWriter(tmp_path / "run", every=fs.AutoInterval(), clock=clock)
    local = fs.CheckpointFileWriter(
        fs.LocalTier(tmp_path / "local"), every=fs.AutoInterval(history=writer.run_history), clock=clock
    )
    with caplog.at_level(logging.INFO, logger="flaxstate"):
        writer(local(dataclasses.replace(recs[2], session=resumed)))
        history = writer.run_history()
        assert (history.failures, history.seconds) == (1, pytest.approx(1000.0))
        assert local.run_history() is None  # no ledger of its own: the policy's history counts
        writer.wait()
        local.wait()
        clock.now += 10
        writer(local(recs[3]))
    writer.close()
    local.close()
    lines = [record.message for record in caplog.records if "saving every" in record.message]
    assert len(lines) == 2 and all("1 in 1010 s of running" in line for line in lines), lines
    events = ledger.read_events(tmp_path / "run" / ledger.FILENAME)
    (change,) = [event for event in events if event["event"] == "cadence"]
    assert change["failures"] == 1 and change["interval"] == pytest.approx(
        math.sqrt(2 * change["cost"] * change["mtbf"])
    )
    report = goodput.report(events)
    assert report["total"]["failures"] == 1 and report["total"]["save_interval"] == pytest.approx(change["interval"])
    assert "save interval (auto)" in goodput.format_report(report)


@dataclasses.dataclass(frozen=True)
class EveryThirdSecond:
    """A policy of a user's own: saves when 3 s have passed since the last save's start, and notes what it saw."""

    seen: list = dataclasses.field(default_factory=list, compare=False)

    def due(self, context: fs.SaveContext) -> bool:
        self.seen.append(context)
        return context.since_start is None or context.since_start >= 3.0


def test_a_policy_of_one_s_own_decides_from_what_the_writer_measured(tmp_path, recs):
    clock, policy = Clock(), EveryThirdSecond()
    assert isinstance(policy, fs.SavePolicy)
    with fs.CheckpointFileWriter(tmp_path, keep=5, every=policy, clock=clock) as writer:
        for record in recs[:5]:  # steps 2, 4, 6, 8, 10, a second apart
            writer(record)
            writer.wait()
            clock.now += 1.0
    assert saved_steps(tmp_path) == [2, 8], saved_steps(tmp_path)  # the first, then 3 s after it started
    first, second = policy.seen[:2]
    assert (first.session_seconds, first.since_save, first.since_start) == (0.0, 0.0, None)
    assert first.save_cost is None and first.in_flight is False
    assert first.history == fs.RunHistory(0, 0.0)  # the writer's ledger: no earlier session
    assert second.since_start == 1.0 and second.session_seconds == 1.0 and second.save_cost is not None
    assert len(policy.seen) == 5


def test_a_policy_whose_due_answers_neither_a_bool_nor_a_decision_is_named(tmp_path, recs):
    @dataclasses.dataclass(frozen=True)
    class Unsure:
        def due(self, context):
            return "maybe"

    with fs.CheckpointFileWriter(tmp_path, every=Unsure()) as writer:
        with pytest.raises(TypeError, match=r"the save policy .*Unsure\(\)'s due\(\) returned 'maybe'; it must"):
            writer(recs[0])
    with pytest.raises(ValueError, match="every must be a save policy"):
        fs.CheckpointFileWriter(tmp_path / "class", every=EveryThirdSecond)  # the class, not a policy
