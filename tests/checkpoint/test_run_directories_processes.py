"""A directory holds one run: writers refuse to mix runs, readers tell damage from other faults.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of run_directories are in test_run_directories.py.
"""

import subprocess
import sys

from flaxstate_testing import processes


def test_a_fallback_says_one_line_and_nothing_after(tmp_path):
    script = f"""
import jax, optax, numpy as np, pathlib, flaxstate as fs
from flaxstate_testing import toy
model = toy.BatchNormNet()
task = fs.TrainTask(model.apply, optax.adam(1e-2), toy.mse, toy.batches(4, 8))
loop = fs.TrainLoop(model.init, task, jax.random.key(0), n_steps=4, n_steps_per_checkpoint=2, stdout=False)
with fs.CheckpointFileWriter({str(tmp_path)!r}, keep=3) as writer:
    for record in loop:
        writer(record)
for file in pathlib.Path({str(tmp_path / "4" / "model")!r}).rglob("*"):
    if file.is_file() and file.parent.name == "d":
        file.unlink()
state = fs.FlaxOptimTrainState.create(optax.adam(1e-2), model.init(jax.random.key(3), np.ones((8, 4), np.float32)))
print("restored", int(fs.CheckpointFileReader({str(tmp_path)!r}).restore(state).step))
"""
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script],
        env={**processes.worker_env(), "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert "restored 2" in result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    damaged = [line for line in lines if "is damaged" in line]
    assert len(damaged) == 1 and f"{tmp_path}/4 is damaged" in damaged[0], result.stderr
    assert "tensorstore_spec" not in result.stderr
    assert "Event loop is closed" not in result.stderr and "never retrieved" not in result.stderr, result.stderr
