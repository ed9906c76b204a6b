"""Tier 1 (tests/README.md): scenarios on the shared cluster's processes, joined by `jax.distributed`. The others of
nnx are in test_nnx.py."""

import json

import numpy as np
from flaxstate_testing import cluster


def test_an_annotated_module_trains_fsdp_over_two_processes_each_holding_half_and_ends_as_one_device():
    # Two gloo processes, a mesh fsdp=2 from the module's own annotations and the rules; one process on one device.
    # Then JAX's explicit way: `jax.make_mesh` (Explicit axes), `jax.set_mesh` around the data and the loop (no
    # `mesh=`), the module's layers called with `out_sharding=`.
    # And the module made with Flax's eager sharding on (its default), inside `jax.set_mesh` and
    # `nn.logical_axis_rules`: its parameters are sharded as they are made, and the loop takes them so.
    results = []
    for n_processes, config in ((2, {}), (1, {}), (2, {"explicit": True}), (2, {"explicit": True, "eager": True})):
        outputs = cluster.run("nnx_sharded", config, n_processes=n_processes, timeout=240)
        line = next(line for line in outputs[0].splitlines() if line.startswith("result "))
        results.append(json.loads(line.removeprefix("result ")))
    sharded, single, explicit, eager = results
    for each in (sharded, explicit, eager):
        assert each["spec"][:2] == ["None", "fsdp"] and each["held"] * 2 == each["kernel"]
    assert sharded["axis_types"] == ["Auto"] and explicit["axis_types"] == eager["axis_types"] == ["Explicit"]
    assert single["held"] == single["kernel"]
    assert eager["made_spec"] == ["None", "fsdp"] and explicit["made_spec"] != eager["made_spec"]
    for path, values in single["final"].items():
        for each in (sharded, explicit, eager):
            np.testing.assert_allclose(each["final"][path], values, rtol=1e-5, atol=1e-6, err_msg=path)


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
