"""After an exception or a Ctrl-C the loop goes on where it stood: no state, step, record or batch lost.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of interrupts are in test_interrupts.py.
"""

import json

import numpy as np
import pytest
from flaxstate_testing import processes


def load(path):
    with np.load(path) as arrays:
        return {key: arrays[key] for key in arrays}


@pytest.mark.parametrize("per_dispatch", [1, 5])
def test_sigints_at_many_moments_leave_every_record_and_a_bit_equal_run(tmp_path, per_dispatch):
    config = {
        "n_steps": 120,
        "every": 10,
        "per_dispatch": per_dispatch,
        "out": str(tmp_path),
        "data_signals": {"7": 1, "23": 2},  # inside the data generator: once, and twice in a row
        "record_signal_steps": [30],  # while the record of step 30 is made
        "data_sleep": 0.001,
    }
    [output] = processes.run("interrupts", config, timeout=300)
    summary = json.loads((tmp_path / "summary.json").read_text())
    # Every record came once, in order, although calls were interrupted before and while records were made.
    assert summary["steps"] == summary["reference_steps"]
    # Raised at a dispatch boundary, after a record was made (kept for the next call), and by the second
    # Ctrl-C inside the data generator, which it finished: the data was re-created and moved on.
    assert {"_dispatch_until", "_train_until", "_draw"} <= set(summary["landed"]), summary["landed"]
    assert "re-created it and moved past the 23 batches drawn" in output
    reference, interrupted = load(tmp_path / "reference.npz"), load(tmp_path / "interrupted.npz")
    assert reference.keys() == interrupted.keys()
    for key in reference:
        np.testing.assert_array_equal(interrupted[key], reference[key], err_msg=key)
