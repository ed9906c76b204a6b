"""Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of digits are in test_digits.py."""

import jax
import numpy as np
import pytest
from conftest import run_example
from test_digits import digits

import flaxstate as fs


def test_example_trains_checkpoints_and_resumes(digits_run):
    output_dir, first, second = digits_run
    assert "Total number of trainable weights: 9,866" in first
    assert "step 20: eval/acc" in first and "Resumed" not in first
    assert "Resumed from the checkpoint at step 20." in second
    assert "step 40: eval/acc" in second and "step 20:" not in second
    assert sorted(p.name for p in output_dir.iterdir() if p.name.isdigit()) == ["20", "40"]
    assert (output_dir / "lowest-eval-loss").is_dir()
    assert list(output_dir.glob("events.out.tfevents.*"))


def test_the_example_with_an_nnx_module_trains_checkpoints_and_resumes(tmp_path):
    first = run_example(tmp_path / "nnx", 20, "--api", "nnx")
    assert "Total number of trainable weights: 9,866" in first and "step 20: eval/acc" in first  # linen's MLP's
    second = run_example(tmp_path / "nnx", 40, "--api", "nnx")
    assert "Resumed from the checkpoint at step 20." in second and "step 40: eval/acc" in second
    restored = fs.CheckpointFileReader(tmp_path / "nnx").read(None)
    assert restored.step == 40 and sorted(restored.state["flax_mutables"]) == ["batch_stats"]
    assert restored.metadata["api"] == "nnx"


def test_the_resumed_example_ends_bit_for_bit_as_an_uninterrupted_run(digits_run, tmp_path):
    resumed_dir, _, _ = digits_run
    run_example(tmp_path / "straight", 40)
    resumed, straight = (fs.CheckpointFileReader(path).read(None) for path in (resumed_dir, tmp_path / "straight"))
    assert resumed.step == straight.step == 40
    assert resumed.data_position == straight.data_position
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(straight.state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_readme_s_next_command_trains_the_nnx_module_beside_the_linen_run_in_a_directory_of_its_own(
    digits_run, tmp_path
):
    # README: `make demo`, then `examples/digits.py --api nnx` in the same folder; the NNX run used to find the
    # linen run's checkpoints in runs/digits and die with a 40-line StateMismatchError that suggested rename=.
    import shutil
    import subprocess
    import sys

    from conftest import ROOT
    from flax import nnx

    shutil.copytree(digits_run[0], tmp_path / "runs" / "digits")
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "digits.py"), "--steps", "20", "--api", "nnx"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "runs" / "digits-nnx" / "20").is_dir() and "No checkpoint found" in done.stdout
    with pytest.raises(fs.StateMismatchError, match="another model's checkpoints .* a directory of its own"):
        fs.nnx_update(digits.NNXMLP(rngs=nnx.Rngs(0)), fs.CheckpointFileReader(tmp_path / "runs" / "digits"))
