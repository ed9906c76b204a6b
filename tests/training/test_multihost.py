"""Multi-host: the same loop across processes, checkpoints saved by all, restored by any number.

Processes have one CPU device each and join over gloo (tests/processes.py);
every run has a hard timeout, and a failure shows every process's output.
"""

import time

import numpy as np
from flaxstate_testing import cluster, processes

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


def test_killing_one_process_ends_the_other_and_both_resume(tmp_path):
    uninterrupted, _ = run(tmp_path, "uninterrupted", 2, n_steps=200)
    config = {
        **CONFIG,
        "output_dir": str(tmp_path / "killed"),
        "out": str(tmp_path / "killed.npz"),
        "n_steps": 200,
        "heartbeat_timeout": 10,
    }
    port = processes.free_port()
    workers = [processes.start("resume.py", config, i, 2, port) for i in range(2)]
    try:
        seen = []
        for line in workers[0].stdout:
            seen.append(line)
            if line.strip() == "record 50":
                break
        assert seen and seen[-1].strip() == "record 50", "".join(seen)
        killed_at = time.monotonic()
        processes.kill(workers[1])
        # The survivor must not hang: it exits, with an error, within a bounded time.
        output = workers[0].communicate(timeout=120)[0]
        waited = time.monotonic() - killed_at
    finally:
        for process in workers:
            processes.kill(process)
            process.wait(timeout=30)
    assert workers[0].returncode != 0, output[-3000:]
    assert "done" not in output
    assert waited < 120
    steps = sorted(int(p.name) for p in (tmp_path / "killed").iterdir() if p.name.isdigit())
    assert steps and steps[-1] >= 40, steps
    resumed, outputs = run(tmp_path, "killed", 2, n_steps=200)
    assert all(f"start {steps[-1]}" in output for output in outputs), outputs
    for key, value in uninterrupted.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)
