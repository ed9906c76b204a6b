"""Export to safetensors: what the `safetensors` package's own API reads back from a run, a record or a state.

Tier 1 (tests/README.md): scenarios on the shared cluster's processes, joined by `jax.distributed`. The others of
safetensors are in test_safetensors.py and test_safetensors_processes.py.
"""

import json

import numpy as np
import safetensors.numpy
from flaxstate_testing import cluster


def test_an_fsdp_start_from_a_file_reads_only_each_process_s_parts_and_trains_as_one_process(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {"linear.weight": rng.normal(size=(64, 4)).astype(np.float32),
               "out.weight": rng.normal(size=(1, 64)).astype(np.float32)}  # fmt: skip
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    whole = sum(t.nbytes for t in tensors.values())
    results = {}
    for n_processes in (2, 1):
        outputs = cluster.run("safetensors_import", {"path": str(tmp_path / "model.safetensors")}, n_processes, 240)
        results[n_processes] = [
            json.loads(next(line for line in out.splitlines() if line.startswith("result ")).removeprefix("result "))
            for out in outputs
        ]
    for process in results[2]:  # each reads its half of each kernel, by byte range, and holds exactly that
        assert process["read"] == whole // 2 and process["shards_match"] and process["spec"] == ["None", "fsdp"]
        np.testing.assert_allclose(process["loss"], results[1][0]["loss"], rtol=1e-5)
    assert results[1][0]["read"] == whole and results[1][0]["shards_match"]
