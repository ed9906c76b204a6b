"""Shardings from logical axes: the rules' checks, the warnings, and a sharded loop on one device.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of sharding are in test_sharding.py and test_sharding_joined.py.
"""

import re

from flaxstate_testing import processes


def test_bad_input_over_two_devices_is_a_clear_error_before_anything_compiles():
    output = processes.run("sharding_errors.py", {}, n_devices=2, timeout=120)[0]
    errors = dict(re.findall(r"^case ([^:]+): (.*)$", output, re.MULTILINE))
    assert re.search(
        r"ValueError: params/Block_0/DenseGeneral_0/kernel has shape \(33, 2, 8\): its dimension 0 \(logical axis "
        r"'embed', size 33\) is sharded over mesh axes \('fsdp',\) of 2 devices",
        errors["odd dimension"],
    )
    assert "dimension 1 (logical axis 'heads', size 3) is sharded over mesh axes ('model',)" in errors["odd heads"]
    assert (
        "batch of size 7, which does not divide by the 2 parts of the batch axes ('data', 'fsdp')"
        in errors["odd batch"]
    )
    assert "do not split into n_microbatches=3" in errors["odd microbatches"]
    assert "mesh axis 'tensor', which the mesh does not have" in errors["unknown mesh axis"]
    assert "compiled 0" in output
