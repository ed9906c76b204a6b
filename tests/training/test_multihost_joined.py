"""Multi-host: the same loop across processes, checkpoints saved by all, restored by any number.

Tier 1 (tests/README.md): scenarios on the shared cluster's processes, joined by `jax.distributed`. The others of
multihost are in test_multihost_processes.py.

Processes have one CPU device each and join over gloo (tests/processes.py);
every run has a hard timeout, and a failure shows every process's output.
"""

import numpy as np
from flaxstate_testing import cluster

CONFIG = {"data": "list", "width": 64, "optimizer": "sgd", "every": 10, "global_batch": 8}


def run(tmp_path, name, n_processes, n_steps, **extra):
    config = {
        **CONFIG,
        "output_dir": str(tmp_path / name),
        "out": str(tmp_path / f"{name}.npz"),
        "n_steps": n_steps,
        **extra,
    }
    outputs = cluster.run("resume", config, n_processes=n_processes, timeout=240)
    return dict(np.load(tmp_path / f"{name}.npz")), outputs


def test_two_processes_write_one_process_restores_and_continues(tmp_path):
    uninterrupted, _ = run(tmp_path, "uninterrupted", 2, n_steps=20)
    run(tmp_path, "handover", 2, n_steps=10)
    continued, outputs = run(tmp_path, "handover", 1, n_steps=20)
    assert "start 10" in outputs[0]
    for key, value in uninterrupted.items():
        np.testing.assert_allclose(continued[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_one_process_writes_two_processes_restore_and_continue(tmp_path):
    uninterrupted, _ = run(tmp_path, "uninterrupted", 1, n_steps=20)
    run(tmp_path, "handover", 1, n_steps=10)
    continued, outputs = run(tmp_path, "handover", 2, n_steps=20)
    assert all("start 10" in output for output in outputs)
    for key, value in uninterrupted.items():
        np.testing.assert_allclose(continued[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
