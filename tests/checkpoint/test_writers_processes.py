"""Writers: when they save (in the background, below the loop's priority), what they keep, how failures surface.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of writers are in test_writers.py and test_writers_joined.py.
"""

import subprocess
import sys

from flaxstate_testing import processes
from flaxstate_testing.checkpoints import fresh_state

import flaxstate as fs

SCRIPT_START = """
import time, jax, optax, orbax.checkpoint as ocp, flaxstate as fs
from flaxstate_testing import processes, toy
from flaxstate_testing.checkpoints import saved_steps
model = toy.BatchNormNet()
task = fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=toy.batches(6, 8))
loop = fs.TrainLoop(model.init, task, jax.random.key(0), n_steps=6, n_steps_per_checkpoint=2, stdout=False)
original = ocp.PyTreeCheckpointHandler.async_save
async def slow(self, *args, **kwargs):  # every array write starts 1 s late, so a save outlives a short script
    time.sleep(1.0)
    return await original(self, *args, **kwargs)
"""


def run_script(body, timeout=240):
    env = processes.worker_env()
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT_START + body], env=env, capture_output=True, text=True, timeout=timeout
    )
    return result.returncode, result.stdout + result.stderr


def test_a_writer_used_as_a_context_manager_finishes_its_save(tmp_path):
    code, output = run_script(f"""
ocp.PyTreeCheckpointHandler.async_save = slow
with fs.CheckpointFileWriter({str(tmp_path)!r}) as writer:
    writer(loop.next_checkpoint())  # not the final record: only the with block waits for it
""")
    assert code == 0, output
    assert int(fs.CheckpointFileReader(tmp_path).restore(fresh_state()).step) == 2


def test_leaving_the_loop_early_finishes_the_pending_save(tmp_path):
    code, output = run_script(f"""
ocp.PyTreeCheckpointHandler.async_save = slow
writer = fs.CheckpointFileWriter({str(tmp_path)!r})
for checkpoint in loop:
    writer(checkpoint)
    break
""")
    assert code == 0, output
    assert int(fs.CheckpointFileReader(tmp_path).restore(fresh_state()).step) == 2


def test_a_save_still_running_when_the_script_ends_exits_1_and_names_it(tmp_path):
    code, output = run_script(f"""
writer = fs.CheckpointFileWriter({str(tmp_path)!r}, keep=3)
writer(loop.next_checkpoint())
writer.wait()
ocp.PyTreeCheckpointHandler.async_save = slow
writer(loop.next_checkpoint())  # step 4: nothing waits for it before the script ends
""")
    assert code == 1, output
    assert f"step 4 to {tmp_path}" in output and "writer.wait()" in output, output
    # What was saved before is intact, and the unfinished step is never restored.
    assert int(fs.CheckpointFileReader(tmp_path).restore(fresh_state()).step) == 2


def test_a_save_that_fails_at_the_last_record_exits_non_zero(tmp_path):
    code, output = run_script(f"""
async def failing(self, *args, **kwargs):
    raise OSError("No space left on device (injected)")
writer = fs.CheckpointFileWriter({str(tmp_path)!r}, keep=3)
for checkpoint in loop:
    if checkpoint.final:
        writer.wait()  # step 4 is on disk; the final save fails
        ocp.PyTreeCheckpointHandler.async_save = failing
    writer(checkpoint)
""")
    assert code != 0, output
    assert "step 6" in output and "No space left on device" in output, output
    assert int(fs.CheckpointFileReader(tmp_path).restore(fresh_state()).step) == 4


def test_an_interrupted_wait_leaves_the_save_pending_and_the_next_wait_reports_it(tmp_path):
    code, output = run_script(f"""
import os, signal, threading
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)
def ctrl_c_soon():
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
ocp.PyTreeCheckpointHandler.async_save = slow
writer = fs.CheckpointFileWriter({str(tmp_path)!r})
writer(loop.next_checkpoint())
ctrl_c_soon()
try:
    writer.wait()
    print("NOT INTERRUPTED")
except KeyboardInterrupt:
    print("INTERRUPTED", saved_steps(Path({str(tmp_path)!r})))
writer.wait()
print("WAITED", saved_steps(Path({str(tmp_path)!r})))
async def failing(self, *args, **kwargs):
    time.sleep(1.0)
    raise OSError("No space left on device (injected)")
ocp.PyTreeCheckpointHandler.async_save = failing
writer(loop.next_checkpoint())
ctrl_c_soon()
try:
    writer.close()
    print("CLOSED")
except KeyboardInterrupt:
    print("INTERRUPTED CLOSE")
try:  # takes over from the idle writer once its save ends: the save's failure is reported here
    fs.CheckpointFileWriter({str(tmp_path)!r})
    print("A SECOND WRITER DESPITE THE FAILED SAVE")
except fs.CheckpointSaveError as error:
    print("REPORTED", error)
fs.CheckpointFileWriter({str(tmp_path)!r}).close()
print("REOPENED")
""")
    assert code == 0, output
    lines = output.splitlines()
    assert "INTERRUPTED []" in lines and "WAITED [2]" in lines, output
    assert "INTERRUPTED CLOSE" in lines, output
    assert "REOPENED" in lines, output  # released once the save ended
    assert any(line.startswith("REPORTED saving the checkpoint of step 4") for line in lines), output
