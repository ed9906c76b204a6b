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


def test_a_decoder_written_in_bonsai_s_style_trains_fsdp_over_two_processes_as_on_one():
    # jax-ml/bonsai's sharded models name each product's output sharding and make their KV cache with a bare
    # PartitionSpec: both need the mesh context, which the loop carries onto the threads where it traces.
    results = []
    for n_processes in (2, 1):
        outputs = cluster.run("decoder_sharded", {}, n_processes=n_processes, timeout=240)
        line = next(line for line in outputs[0].splitlines() if line.startswith("result "))
        results.append(json.loads(line.removeprefix("result ")))
    sharded, single = results
    # Each process holds half of each 3-D attention kernel, cut on its embedding axis.
    assert sharded["spec"] == ["fsdp", "None", "None"] and sharded["held"] * 2 == sharded["kernel"]
    assert sharded["axis_types"] == single["axis_types"] == ["Explicit"] and single["held"] == single["kernel"]
    np.testing.assert_allclose(sharded["losses"], single["losses"], rtol=1e-5)
    assert len(single["losses"]) == 3 and single["losses"][-1] < single["losses"][0]
    for path, values in single["final"].items():
        np.testing.assert_allclose(sharded["final"][path], values, rtol=1e-5, atol=1e-6, err_msg=path)
