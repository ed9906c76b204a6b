"""Checkpoints broken as users break them: Ctrl-C inside a restore, damaged files, hostile shapes, full disks.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of damage are in test_damage.py.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import tensorstore as ts
from flaxstate_testing import processes
from flaxstate_testing.checkpoints import fresh_state, records

import flaxstate as fs


def test_ctrl_c_anywhere_in_a_restore_comes_out_as_keyboard_interrupt(tmp_path):
    directory = tmp_path / "ck"
    attempts = 12
    worker = processes.Watched(
        processes.start(
            "checkpoint_faults", {"mode": "restore_interrupts", "dir": str(directory), "attempts": attempts}
        )
    )
    worker.wait_for("RESTORE SECONDS", 240)
    seconds = float(next(line for line in worker.lines if line.startswith("RESTORE SECONDS")).split()[-1])
    chance = random.Random(0)
    for attempt in range(attempts):
        worker.wait_for(f"START {attempt}", 120)
        time.sleep(chance.uniform(0.0, seconds))  # lands anywhere in the restore (or just after it)
        os.kill(worker.process.pid, signal.SIGINT)
        (directory / f"sent-{attempt}").touch()
    worker.wait_for("DONE", 120)
    assert worker.finish(60) == 0, worker.output
    outcomes = [line.split()[0] for line in worker.lines if line.split()[0] in ("RESTORED", "INTERRUPTED", "FAULT")]
    assert "FAULT" not in outcomes, worker.output[-3000:]
    assert outcomes.count("INTERRUPTED") >= 1, worker.output[-3000:]
    assert "DONE 7" in worker.output
    assert "Traceback" not in worker.output, worker.output[-3000:]


HALF_CLOSED_LOOP = """
import asyncio, gc
from flaxstate.checkpoint.damage import quiet_orbax

quiet_orbax()
loop = asyncio.new_event_loop()
loop._ssock.close()  # a Ctrl-C between the self-pipe's close and its reset, inside loop.close()
del loop
gc.collect()


class Broken:
    def __del__(self):
        raise ValueError("a bug of the user's, still reported")


Broken()
gc.collect()
print("END")
"""


def test_an_event_loop_whose_close_a_ctrl_c_stopped_halfway_is_not_reported_and_other_errors_are():
    result = subprocess.run(
        [sys.executable, "-c", HALF_CLOSED_LOOP],
        env=processes.worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "END" in result.stdout, result.stdout + result.stderr
    assert "BaseEventLoop.__del__" not in result.stderr, result.stderr
    assert "Invalid file descriptor" not in result.stderr, result.stderr
    assert "a bug of the user's, still reported" in result.stderr, result.stderr


def claim_shape(step_dir, array, shape):
    """Rewrites one array's stored zarr metadata (inside the OCDBT store) to claim another shape."""
    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{step_dir}/model/"}).result()
    key = f"{array}/.zarray"
    zarray = json.loads(store.read(key).result().value)
    zarray["shape"] = zarray["chunks"] = list(shape)
    store.write(key, json.dumps(zarray).encode()).result()


HOSTILE_READ = """
import sys, flaxstate as fs
try:
    fs.CheckpointFileReader(sys.argv[1]).read(None)
except fs.CheckpointError as error:
    print("CheckpointError:", error)
"""


def read_in_a_process(directory):
    """Reads the newest checkpoint with no template in a process of its own (an allocation of 160 GB would
    abort it); returns the finished process, which must have exited 0."""
    result = subprocess.run(
        [sys.executable, "-c", HOSTILE_READ, str(directory)],
        env=processes.worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_a_hostile_shape_is_refused_before_anything_is_allocated(tmp_path, caplog):
    writer = fs.CheckpointFileWriter(tmp_path, keep=3)
    recs = records(4, 2)
    for record in recs:
        writer(record)
    writer.close()
    claim_shape(tmp_path / "4", "target.Dense_0.kernel", (200_000, 200_000))
    # With no template:
    result = read_in_a_process(tmp_path)
    assert f"{tmp_path}/4 is damaged" in result.stderr  # falls back to step 2
    claim_shape(tmp_path / "2", "target.Dense_0.kernel", (200_000, 200_000))
    result = read_in_a_process(tmp_path)
    assert "target/Dense_0/kernel claims shape [200000, 200000] (160,000,000,000 bytes)" in result.stdout
    assert "the step's files hold" in result.stdout
    # With a template, the shapes are compared first: a clear mismatch, nothing read.
    with pytest.raises(
        fs.StateMismatchError,
        match=r"target/Dense_0/kernel \(expected float32\[4, 8\], found float32\[200000, 200000\]\)",
    ):
        fs.CheckpointFileReader(tmp_path).restore(fresh_state())


def test_a_failed_save_says_one_line_and_leaves_no_partial_folder(tmp_path):
    output = processes.run("checkpoint_faults", {"mode": "full_disk", "dir": str(tmp_path)}, timeout=240)[0]
    failed = [line for line in output.splitlines() if line.startswith("SAVE FAILED")]
    assert [line.split()[2] for line in failed] == ["4:", "6:"], output
    assert "partial files were removed" in failed[0]
    assert "LEFT ['2']" in output
    assert "Traceback" not in output and len(output.splitlines()) <= 4, output
    assert fs.CheckpointFileReader(tmp_path).read(None).step == 2
