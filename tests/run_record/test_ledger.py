"""The goodput ledger as the run directory's writer keeps it: one run a ledger, torn lines, the records' times."""

import json

import pytest
from flaxstate_testing import toy
from flaxstate_testing.loops import make_loop

import flaxstate as fs
from flaxstate import cli
from flaxstate.run_record import goodput, ledger


def train(run_dir, loop=None, **writer_options):
    loop = make_loop() if loop is None else loop
    with fs.CheckpointFileWriter(run_dir, **writer_options) as writer:
        return [writer(record) for record in loop]


def kinds(run_dir):
    return [event["event"] for event in ledger.read_events(run_dir / ledger.FILENAME)]


def test_a_run_logs_its_session_records_saves_and_end_with_the_records_own_times(tmp_path):
    records = train(tmp_path)
    events = ledger.read_events(tmp_path / ledger.FILENAME)
    assert kinds(tmp_path) == ["session"] + ["record", "save"] * 2 + ["completed", "record", "save", "completed"] + [
        "completed",
        "end",
    ]  # a save is known complete when the next one (or the final wait) waited for it
    completed = [event for event in events if event["event"] == "completed"]
    assert [event["step"] for event in completed] == [4, 8, 12] and all(event["seconds"] > 0 for event in completed)
    logged = [event for event in events if event["event"] == "record"]
    for event, record in zip(logged, records, strict=True):
        assert event["step"] == record.step and event["steps"] == record.n_completed_steps
        assert event["elapsed"] == record.elapsed_time and event["compile"] == record.compile_time
        assert event["idle"] == record.idle_time and event["outside"] == record.outside_time
    assert {event["run_id"] for event in events} == {records[0].run_id}
    session = events[0]
    assert session["startup"] == records[0].session.startup > 0 and session["restored_step"] is None
    assert records[0].compile_time > 0  # the first record compiled the update
    assert all(record.compile_time < record.elapsed_time for record in records)


def test_a_torn_last_line_is_skipped_and_the_next_session_starts_on_a_line_of_its_own(tmp_path):
    train(tmp_path, loop=make_loop(n_steps=8))
    with open(tmp_path / ledger.FILENAME, "a") as torn:
        torn.write('{"event": "record", "step": 12, "ste')  # a kill -9 in the middle of a line
    assert kinds(tmp_path)[-1] == "end"
    resumed = make_loop(init=fs.CheckpointFileReader(tmp_path, target=toy.MLP().init), n_steps=12)
    train(tmp_path, loop=resumed)
    assert kinds(tmp_path).count("session") == 2
    report = goodput.report(ledger.read_events(tmp_path / ledger.FILENAME))
    assert [session["restored_step"] for session in report["sessions"]] == [None, 8]
    assert report["total"]["steps"] == 12 and report["total"]["lost_steps"] == 0


def test_a_line_of_bytes_that_are_not_utf_8_is_skipped_with_one_warning_wherever_the_ledger_is_read(
    tmp_path, caplog, capsys
):
    # A torn write on a full disk, or a flipped bit: the line is skipped, the rest read, the run goes on.
    train(tmp_path, loop=make_loop(n_steps=8))
    path = tmp_path / ledger.FILENAME
    lines = path.read_bytes().splitlines(keepends=True)
    lines.insert(2, b'{"event": "record", "step": 4, "st\xff\xfeps": 4}\n')
    path.write_bytes(b"".join(lines))
    with caplog.at_level("WARNING", logger="flaxstate"):
        assert kinds(tmp_path)[-1] == "end" and kinds(tmp_path).count("record") == 2
        assert "damaged line(s) (line 3 first" in caplog.text and caplog.text.count("damaged line") == 1
        for command in ("goodput", "audit"):  # they ended in a UnicodeDecodeError's traceback
            assert cli.main([command, str(tmp_path)]) == 0
        assert "lost steps" in capsys.readouterr().out.lower()
        resumed = make_loop(init=fs.CheckpointFileReader(tmp_path, target=toy.MLP().init), n_steps=12)
        assert train(tmp_path, loop=resumed)[-1].step == 12  # the resumed run's writer raised at its first record
    assert kinds(tmp_path).count("session") == 2
    assert cli.main(["audit", str(tmp_path)]) == 0


def test_a_fresh_run_over_another_runs_directory_moves_that_ledger_aside(tmp_path):
    first = train(tmp_path, loop=make_loop(n_steps=4))
    old_lines = (tmp_path / ledger.FILENAME).read_text()
    second = train(tmp_path, loop=make_loop(n_steps=4, seed=1), overwrite=True)
    assert first[0].run_id != second[0].run_id
    aside = tmp_path / f"goodput-{first[0].run_id}.jsonl"
    assert aside.read_text() == old_lines  # kept, whole
    runs = {event["run_id"] for event in ledger.read_events(tmp_path / ledger.FILENAME)}
    assert runs == {second[0].run_id}


def test_a_refused_directory_keeps_the_other_runs_ledger_where_it_is(tmp_path):
    train(tmp_path, loop=make_loop(n_steps=4))
    before = (tmp_path / ledger.FILENAME).read_text()
    with pytest.raises(fs.CheckpointError, match="another run"):
        train(tmp_path, loop=make_loop(n_steps=4, seed=1))
    assert (tmp_path / ledger.FILENAME).read_text() == before
    assert not list(tmp_path.glob("goodput-*.jsonl"))


def test_ledger_false_writes_none_and_best_writers_keep_none(tmp_path):
    train(tmp_path, ledger=False)
    assert not (tmp_path / ledger.FILENAME).exists()
    loop = make_loop()
    with fs.LowestCheckpointFileWriter(tmp_path / "best", metric="loss", group="train") as best:
        for record in loop:
            best(record.with_metrics({"train": {"loss": record.loss}}))
    assert not list((tmp_path / "best").rglob(ledger.FILENAME))


def test_the_report_of_events_written_by_hand():
    session = {"event": "session", "time": 100.0, "pid": 1, "startup": 2.0, "run_id": "r", "restored_step": None}
    events = [
        session,
        {
            "event": "record",
            "time": 110.0,
            "step": 10,
            "steps": 10,
            "elapsed": 5.0,
            "compile": 1.0,
            "data_wait": 0.5,
            "idle": 1.0,
            "outside": 0.0,
            "run_id": "r",
        },
        {"event": "save", "time": 111.0, "step": 10, "blocking": 0.5, "run_id": "r"},
        {
            "event": "record",
            "time": 120.0,
            "step": 20,
            "steps": 10,
            "elapsed": 4.0,
            "compile": 0.0,
            "data_wait": 0.0,
            "idle": 0.0,
            "outside": 5.0,
            "run_id": "r",
        },
        {"event": "session", "time": 130.0, "pid": 2, "startup": 3.0, "run_id": "r", "restored_step": 10},
        {
            "event": "record",
            "time": 140.0,
            "step": 20,
            "steps": 10,
            "elapsed": 4.0,
            "compile": 0.0,
            "data_wait": 0.0,
            "idle": 0.0,
            "outside": 0.0,
            "run_id": "r",
        },
        {
            "event": "record",
            "time": 141.0,
            "step": 99,
            "steps": 1,
            "elapsed": 1.0,
            "compile": 0.0,
            "data_wait": 0.0,
            "idle": 0.0,
            "outside": 0.0,
            "run_id": "another",
        },
    ]
    report = goodput.report(json.loads(json.dumps(events)))
    first, second = report["sessions"]
    assert first["wall_time"] == 20.0 and second["wall_time"] == 10.0 + 10.0  # its down time included
    assert first["lost_steps"] == 10 and first["lost_progress"] == 4.0  # step 20's record, trained again
    assert first["productive"] == 3.0  # (5 - 1 - 1), the kept record's
    assert first["compile"] == 1.0 and first["data_wait"] == 0.5 and first["host_idle"] == 0.5
    assert first["checkpoint"] == 0.5 and first["startup"] == 2.0
    assert first["outside_loop"] == pytest.approx(20.0 - 3.0 - 1.0 - 0.5 - 0.5 - 0.5 - 2.0 - 4.0)
    assert second["down_time"] == 10.0 and second["steps"] == 10  # another run's event is not counted
    assert report["total"]["wall_time"] == 40.0
    assert report["total"]["goodput"] == pytest.approx((3.0 + 4.0) / 40.0)


def test_a_ledger_cut_after_its_session_line_gives_no_negative_bucket(tmp_path):
    train(tmp_path, loop=make_loop(n_steps=8))
    path = tmp_path / ledger.FILENAME
    lines = path.read_text().splitlines(keepends=True)
    for cut in (1, 2):  # killed right after the session line, and after the first record's
        path.write_text("".join(lines[:cut]))
        (account,) = goodput.report(ledger.read_events(path))["sessions"]
        assert all(account[name] >= 0 for name in goodput.BUCKETS), account
        parts = account["productive"] + sum(account[name] for name in goodput.BUCKETS)
        assert parts == pytest.approx(account["wall_time"])
        assert account["wall_time"] >= account["startup"] > 0
    resumed = make_loop(init=fs.CheckpointFileReader(tmp_path, target=toy.MLP().init), n_steps=12)
    train(tmp_path, loop=resumed)
    first, second = goodput.report(ledger.read_events(path))["sessions"]
    assert first["wall_time"] >= first["startup"] > 0 and second["down_time"] >= 0
    assert all(account[name] >= 0 for account in (first, second) for name in goodput.BUCKETS)


def test_two_sessions_of_one_process_keep_the_ledger_s_order_whatever_the_jitter_of_their_start():
    def session(started, restored, startup=0.1):
        return {
            **{"event": "session", "time": started, "pid": 1, "startup": startup},
            **{"restored_step": restored, "run_id": "r"},
        }

    def step(at, step):
        return {
            **{"event": "record", "time": at, "step": step, "steps": 4, "elapsed": 0.5},
            **{"compile": 0.0, "data_wait": 0.0, "idle": 0.0, "outside": 0.0, "run_id": "r"},
        }

    # One process's start, read from /proc twice: the second reading came out a microsecond earlier.
    events = [session(100.000001, None), step(101.0, 4), step(102.0, 8), session(100.0, 8), step(103.0, 12)]
    report = goodput.report(events)
    assert [account["restored_step"] for account in report["sessions"]] == [None, 8]
    assert [account["steps"] for account in report["sessions"]] == [8, 4] and report["total"]["lost_steps"] == 0
    # The same start, read alike: the second loop's session is its own (its startup), a second writer's line is not.
    events = [session(100.0, None), step(101.0, 4), session(100.0, None), step(102.0, 8)]
    events += [session(100.0, 8, startup=2.5), session(100.0, 8, startup=2.5), step(103.0, 12)]
    report = goodput.report(events)
    assert [account["restored_step"] for account in report["sessions"]] == [None, 8]
    assert [account["steps"] for account in report["sessions"]] == [8, 4]
