"""Tier 1 (tests/README.md): scenarios on the shared cluster's processes, joined by `jax.distributed`. The others of
nnx are in test_nnx.py."""

import json

import numpy as np
from flaxstate_testing import cluster


def test_an_annotated_module_trains_fsdp_over_two_processes_each_holding_half_and_ends_as_one_device():
    # Two gloo processes, a mesh fsdp=2 from the module's own annotations and the rules; one process on one device.
    # Then JAX's explicit way: `jax.make_mesh` (Explicit axes), `jax.set_mesh` around the data and the loop (no
    # `mesh=`), the module's layers called with `out_sharding=`.
    results = []
    for n_processes, explicit in ((2, False), (1, False), (2, True)):
        outputs = cluster.run("nnx_sharded", {"explicit": explicit}, n_processes=n_processes, timeout=240)
        line = next(line for line in outputs[0].splitlines() if line.startswith("result "))
        results.append(json.loads(line.removeprefix("result ")))
    sharded, single, explicit = results
    assert sharded["spec"][:2] == ["None", "fsdp"] and sharded["held"] * 2 == sharded["kernel"]
    assert explicit["spec"][:2] == ["None", "fsdp"] and explicit["held"] * 2 == explicit["kernel"]
    assert sharded["axis_types"] == ["Auto"] and explicit["axis_types"] == ["Explicit"]
    assert single["held"] == single["kernel"]
    for path, values in single["final"].items():
        np.testing.assert_allclose(sharded["final"][path], values, rtol=1e-5, atol=1e-6, err_msg=path)
        np.testing.assert_allclose(explicit["final"][path], values, rtol=1e-5, atol=1e-6, err_msg=path)
