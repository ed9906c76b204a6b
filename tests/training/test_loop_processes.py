"""Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of loop are in test_loop.py and test_loop_joined.py."""

from flaxstate_testing import processes


def test_batch_not_divisible_by_device_count_names_both_numbers(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(
        "import jax, optax, flaxstate as fs\n"
        "from flaxstate_testing import toy\n"
        "assert jax.device_count() == 2\n"
        "task = fs.TrainTask(toy.MLP().apply, optax.sgd(0.1), toy.mse, toy.batches(2, 7))\n"
        "try:\n"
        "    fs.TrainLoop(toy.MLP().init, task, jax.random.key(0), n_steps=2, stdout=False).next_checkpoint()\n"
        "except ValueError as error:\n"
        "    print('ERROR', error)\n"
    )
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, str(script)],
        env=processes.worker_env(n_devices=2),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "ERROR TrainTask.data yielded a batch of size 7, which does not divide by the 2 local devices" in (
        result.stdout
    ), result.stdout + result.stderr


UNFINISHED = """
import optax, flaxstate as fs
from flaxstate_testing import toy
model = toy.MLP()
task = fs.TrainTask(apply=model.apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=toy.batches(6, 8))
with fs.CheckpointFileWriter({run!r}) as writer:
    records = iter(fs.TrainLoop(model.init, task, 0, n_steps=6, n_steps_per_checkpoint=2, stdout=False))
    writer(next(records))
print("end of script")
"""


def test_a_loop_left_unfinished_at_the_script_s_end_prints_nothing_and_keeps_the_script_s_status(tmp_path):
    # The generator used to end during the interpreter's teardown: "Exception ignored in: <generator object
    # TrainLoop.__iter__>" and a TypeError from modules already gone.
    import subprocess
    import sys

    script = UNFINISHED.format(run=str(tmp_path / "run"))
    result = subprocess.run(  # faulthandler: a crash at exit prints every thread's stack
        [sys.executable, "-X", "faulthandler", "-c", script],
        env=processes.worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "end of script", result
    assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert (tmp_path / "run" / "2").is_dir()
