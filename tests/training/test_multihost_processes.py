"""Multi-host: the same loop across processes, checkpoints saved by all, restored by any number.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of multihost are in test_multihost_joined.py.

Processes have one CPU device each and join over gloo (tests/processes.py);
every run has a hard timeout, and a failure shows every process's output.
"""

import time

import numpy as np
from flaxstate_testing import processes
from test_multihost_joined import CONFIG, run


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
