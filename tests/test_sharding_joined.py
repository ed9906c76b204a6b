"""Shardings from logical axes: the rules' checks, the warnings, and a sharded loop on one device.

Tier 1 (tests/README.md): scenarios on the shared cluster's processes, joined by `jax.distributed`. The others of
sharding are in test_sharding.py and test_sharding_processes.py.
"""

import re

from flaxstate_testing import cluster


def test_tensor_parallel_data_split_over_two_processes_as_data_parallel_is_refused_naming_both_splits():
    outputs = cluster.run("sharding_errors", {}, n_processes=2, timeout=120)
    for index, output in enumerate(outputs):
        error = dict(re.findall(r"^case ([^:]+): (.*)$", output, re.MULTILINE))[
            "tensor-parallel data split as data-parallel"
        ]
        assert error.startswith("ValueError: TrainTask data is global_batches("), error
        assert f"feeds this process part {index} of 2 of each global batch" in error, error
        assert "places part 0 of 1 on this process's devices" in error and "mesh=mesh, axis_rules=axis_rules" in error
        assert "compiled 0" in output
