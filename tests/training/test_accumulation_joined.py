"""Gradient accumulation (`n_microbatches`): M microbatches a step, the update of the whole batch.

Tier 1 (tests/README.md): scenarios on the shared cluster's processes, joined by `jax.distributed`. The others of
accumulation are in test_accumulation.py.
"""

import numpy as np
from flaxstate_testing import cluster


def train_processes(tmp_path, name, n_processes, n_microbatches):
    out = tmp_path / name
    out.mkdir()
    config = {
        "model": "mlp",
        "n_steps": 4,
        "global_batch": 16,
        "out": str(out),
        "optimizer": "adam",
        "n_microbatches": n_microbatches,
    }
    cluster.run("train", config, n_processes=n_processes, timeout=240)
    return [dict(np.load(out / f"process_{i}.npz")) for i in range(n_processes)]


def test_microbatches_over_two_processes_equal_one_device_on_the_whole_batch(tmp_path):
    one = train_processes(tmp_path, "one", 1, n_microbatches=1)[0]
    two = train_processes(tmp_path, "two", 2, n_microbatches=4)
    for key, value in one.items():
        np.testing.assert_allclose(two[0][key], value, rtol=1e-5, atol=2e-6, err_msg=key)
        np.testing.assert_array_equal(two[0][key], two[1][key], err_msg=f"processes differ at {key}")
