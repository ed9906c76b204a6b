"""TrainTask(ema_decay=...): an EMA of the parameters inside the compiled step, saved, resumed and evaluated.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of ema are in test_ema.py.
"""

import time

import numpy as np
from flaxstate_testing import cluster, processes
from test_ema import DECAY


def test_kill_9_then_resume_ends_bit_for_bit_as_a_straight_run_the_ema_included(tmp_path):
    config = {"n_steps": 40, "every": 10, "data": "list", "optimizer": "sgd", "keep": 2, "ema_decay": DECAY}
    reference = tmp_path / "reference.npz"
    cluster.run("resume", dict(config, output_dir=str(tmp_path / "reference"), out=str(reference), resume=False), 1)
    killed = dict(config, output_dir=str(tmp_path / "killed"), out=str(tmp_path / "a.npz"), data_sleep=0.02)
    worker = processes.Watched(processes.start("resume", dict(killed, resume=False)))
    worker.wait_for("record 20", timeout=120)
    time.sleep(0.1)  # a few steps past the record
    processes.kill(worker.process)
    worker.finish(timeout=30)
    resumed = tmp_path / "b.npz"
    output = cluster.run("resume", dict(killed, out=str(resumed), data_sleep=0), n_processes=1)[0]
    assert "start 10" in output or "start 20" in output
    with np.load(resumed) as got, np.load(reference) as want:
        assert got.keys() == want.keys() and any(key.startswith("state/ema/") for key in want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
