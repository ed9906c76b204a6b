"""`fs.WeightMap`: HF's Llama/Qwen3 files (as `safetensors.numpy.save_file` writes them, HF's names and 2-D

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of weight_map are in test_weight_map.py and test_weight_map_joined.py.
shapes) into decoders whose attention kernels are 3-D, NNX and linen, and back out in HF's layout; every expected
array is rearranged by hand (`decoders.held`), apart from einops.
"""

import numpy as np
import safetensors.numpy
from flaxstate_testing.command_line import run_here
from test_weight_map import fine_tune, flat, hf_of

import flaxstate as fs


def test_flaxstate_export_map_reads_the_table_from_json(tmp_path):
    _, rules, loop = fine_tune(tmp_path, "nnx", tied=False, n_steps=2)
    with fs.CheckpointFileWriter(tmp_path / "run") as writer:
        record = [writer(record) or record for record in loop][-1]
    (tmp_path / "map.json").write_text(fs.WeightMap(rules).to_json())
    done = run_here("export", tmp_path / "run", tmp_path / "out", "--map", tmp_path / "map.json")
    assert done.returncode == 0, done.stderr
    written = safetensors.numpy.load_file(tmp_path / "out" / "model.safetensors")
    for name, value in hf_of("nnx", flat(record.state.params), tied=False).items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    (tmp_path / "bad.json").write_text('[["q", "q.weight"]]')
    bad = run_here("export", tmp_path / "run", tmp_path / "other", "--map", tmp_path / "bad.json")
    assert bad.returncode == 2 and "bad.json holds a JSON list" in bad.stderr and not (tmp_path / "other").exists()
