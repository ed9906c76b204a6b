"""Export to safetensors: what the `safetensors` package's own API reads back from a run, a record or a state.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of safetensors are in test_safetensors.py and test_safetensors_joined.py.
"""

import os
import re
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flaxstate_testing.command_line import run_here
from test_safetensors import Wide, params_of, trained

import flaxstate as fs
from flaxstate.checkpoint.safetensors import STAGING


def test_flaxstate_export_writes_a_step_in_bfloat16(tmp_path):
    records = trained(tmp_path, Wide())
    done = run_here("export", tmp_path / "run", tmp_path / "hf", "--step", "3", "--dtype", "bfloat16")
    assert done.returncode == 0, done.stderr
    assert "model.safetensors" in done.stdout
    loaded = safetensors.numpy.load_file(tmp_path / "hf" / "model.safetensors")
    expected = params_of(records[0].state.params)  # step 3's
    for name, value in expected.items():
        np.testing.assert_array_equal(loaded[name], value.astype(ml_dtypes.bfloat16))
    bad = run_here("export", tmp_path / "run", tmp_path / "hf", "--dtype", "int7")
    assert bad.returncode == 2 and "'int7' is not a dtype" in bad.stderr


def test_an_output_that_is_a_file_is_named_and_a_killed_export_s_staging_is_removed_by_the_next(tmp_path):
    trained(tmp_path, Wide())
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ValueError, match=rf"{re.escape(str(tmp_path / 'file'))} is a file, not a folder"):
        fs.export_safetensors(tmp_path / "run", tmp_path / "file")
    with pytest.raises(ValueError, match=r"cannot be made: .*file is a file, not a folder"):
        fs.export_safetensors(tmp_path / "run", tmp_path / "file" / "out")
    refused = run_here("export", tmp_path / "run", tmp_path / "file")
    assert refused.returncode == 2 and "is a file, not a folder" in refused.stderr and "damaged" not in refused.stderr
    out = tmp_path / "hf"
    out.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = out / f"{STAGING}{int(gone.stdout)}-x1"  # an export's, killed: its process is gone
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(bytes(1 << 20))
    older = out / f"{STAGING}abcd1234"  # named as earlier versions named theirs
    older.mkdir()
    running = out / f"{STAGING}{os.getpid()}-y2"  # a running export's
    running.mkdir()
    fs.export_safetensors(tmp_path / "run", out)
    assert sorted(entry.name for entry in out.iterdir()) == sorted(["model.safetensors", running.name])
