"""`fs.WeightMap`: HF's Llama/Qwen3 files (as `safetensors.numpy.save_file` writes them, HF's names and 2-D

Tier 1 (tests/README.md): scenarios on the shared cluster's processes, joined by `jax.distributed`. The others of
weight_map are in test_weight_map.py and test_weight_map_processes.py.
shapes) into decoders whose attention kernels are 3-D, NNX and linen, and back out in HF's layout; every expected
array is rearranged by hand (`decoders.held`), apart from einops.
"""

import json

import numpy as np
import pytest
import safetensors.numpy
from flaxstate_testing import cluster


@pytest.mark.parametrize("cut", ["heads", "head_dim"])
def test_a_two_process_fsdp_import_through_a_layout_reads_each_process_s_heads_or_the_tensor_once(tmp_path, cut):
    rng = np.random.default_rng(1)
    tensors = {"linear.weight": rng.normal(size=(64, 4)).astype(np.float32),  # (heads * head_dim, embed)
               "out.weight": rng.normal(size=(1, 64)).astype(np.float32)}  # fmt: skip
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    whole = sum(t.nbytes for t in tensors.values())
    results = {}
    for n_processes in (2, 1):
        config = {"path": str(tmp_path / "model.safetensors"), "heads": cut}
        outputs = cluster.run("safetensors_import", config, n_processes, 240)
        results[n_processes] = [
            json.loads(next(line for line in out.splitlines() if line.startswith("result ")).removeprefix("result "))
            for out in outputs
        ]
    spec = ["None", "fsdp", "None"] if cut == "heads" else ["None", "None", "fsdp"]
    for process in results[2]:  # heads: the rows of its heads alone; head_dim: no part is one block, read once
        assert process["read"] == (whole // 2 if cut == "heads" else whole), process
        assert process["shards_match"] and process["spec"] == spec, process
        np.testing.assert_allclose(process["loss"], results[1][0]["loss"], rtol=1e-5)
    assert results[1][0]["read"] == whole and results[1][0]["shards_match"]
