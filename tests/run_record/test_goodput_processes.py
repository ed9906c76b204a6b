"""The goodput ledger of real runs: `kill -9` and restart, SIGTERM and restart, two gloo processes.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of goodput are in test_goodput.py.

Each run is a worker process (`workers/resume.py`: `for c in loop: writer(c)`)
with a hard timeout; the ledger is read back through `flaxstate goodput DIR --json`.
"""

import json
import signal
import subprocess
import sys
import time

import pytest
from flaxstate_testing import cluster, command_line, processes
from test_goodput import assert_adds_up

from flaxstate.run_record import ledger

CONFIG = {"n_steps": 60, "every": 10, "data": "list", "optimizer": "sgd", "keep": 2, "data_sleep": 0.02}


def goodput_json(run_dir):
    done = command_line.run_here("goodput", run_dir, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_kill_9_between_checkpoints_then_restart_counts_the_steps_trained_twice(tmp_path):
    run_dir = tmp_path / "run"
    # Saves only step 20 (and the final one): killed after the record of step 40, 20 steps are trained twice.
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), save_steps=[20], resume=False)
    config["wait_saved"] = True  # step 20 committed before the kill, however loaded the machine
    began = time.time()
    worker = processes.Watched(processes.start("resume", config))
    worker.wait_for("record 40", timeout=120)
    time.sleep(0.1)  # a few steps into the next record's
    processes.kill(worker.process)
    worker.finish(timeout=30)
    killed = time.time()
    time.sleep(1.0)  # down time
    output = processes.run("resume", dict(config, resume=True, out=str(tmp_path / "b.npz")))[0]
    assert "start 20" in output
    ended = time.time()

    report = goodput_json(run_dir)
    first, second = report["sessions"]
    assert first["restored_step"] is None and second["restored_step"] == 20
    assert first["last_step"] >= 40
    assert first["lost_steps"] == first["last_step"] - 20  # the records past the checkpoint resumed from
    assert first["lost_progress"] > 0 and second["lost_steps"] == 0
    assert report["total"]["lost_steps"] == first["lost_steps"]
    assert not first["ended"] and second["ended"]
    assert first["failed"] and not second["failed"] and report["total"]["failures"] == 1  # what every="auto" reads
    assert report["total"]["lost_per_failure"] == pytest.approx(first["lost_progress"])
    assert 1.0 <= second["down_time"] < 1.0 + 30
    assert first["wall_time"] <= killed - began + 1.0  # the process's start to its last event
    assert report["total"]["wall_time"] <= ended - began + 1.0
    assert report["total"]["wall_time"] == pytest.approx(first["wall_time"] + second["wall_time"])
    for account in (first, second, report["total"]):
        assert_adds_up(account)
    text = subprocess.run(
        [sys.executable, "-m", "flaxstate", "goodput", str(run_dir)], capture_output=True, text=True, check=True
    ).stdout
    assert "lost steps" in text and "session 2" in text and "down time" in text


def test_sigterm_then_restart_loses_no_progress_and_counts_the_preemption_and_the_down_time(tmp_path):
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), resume=False, outside_sleep=0.1)
    worker = processes.Watched(processes.start("resume", config))
    worker.wait_for("record 20", timeout=120)
    worker.process.send_signal(signal.SIGTERM)
    assert worker.finish(timeout=60) == 0
    time.sleep(0.5)
    processes.run("resume", dict(config, resume=True, out=str(tmp_path / "b.npz")))

    report = goodput_json(run_dir)
    first, second = report["sessions"]
    assert first["preemptions"] == 1 and first["ended"] and report["total"]["failures"] == 0  # a preemption saves
    assert second["restored_step"] == first["last_step"]
    assert report["total"]["lost_steps"] == 0 and report["total"]["lost_progress"] == 0
    assert report["total"]["preemptions"] == 1
    assert second["down_time"] >= 0.5
    assert report["total"]["down_time"] == second["down_time"]
    # The caller slept 0.1 s before handing each record on: that time is outside the loop.
    n_records = sum(1 for event in ledger.read_events(run_dir / ledger.FILENAME) if event["event"] == "record")
    assert report["total"]["outside_loop"] >= 0.1 * (n_records - 2)
    assert report["total"]["steps"] == 60
    for account in (first, second, report["total"]):
        assert_adds_up(account)


def test_two_processes_write_one_ledger_once(tmp_path):
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), resume=False, data_sleep=0)
    cluster.run("resume", config, n_processes=2)
    events = ledger.read_events(run_dir / ledger.FILENAME)
    assert [event["event"] for event in events].count("session") == 1
    assert [event["step"] for event in events if event["event"] == "record"] == [10, 20, 30, 40, 50, 60]
    assert [event for event in events if event["event"] == "session"][0]["processes"] == 2
    report = goodput_json(run_dir)
    assert len(report["sessions"]) == 1 and report["total"]["steps"] == 60
    assert_adds_up(report["total"])
