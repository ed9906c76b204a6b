"""Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of lm are in test_lm.py."""

import dataclasses
import re
import subprocess
import sys

from conftest import ROOT
from test_lm import lm

import flaxstate as fs

SMALL = ["--embed", "16", "--heads", "2", "--head-dim", "8", "--mlp", "32", "--layers", "1", "--seq-len", "16"]


def run_lm(output_dir, steps, *flags, check=True):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lm.py"), "--steps", str(steps), "--output-dir", str(output_dir)]
        + ["--steps-per-checkpoint", "10", *SMALL, *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 or not check, result.stdout + result.stderr
    return result


def test_the_example_trains_resumes_and_stores_its_config_with_every_checkpoint(tmp_path):
    first = run_lm(tmp_path / "run", 10).stdout
    assert re.search(r"step 10: eval/loss [\d.]+  train/loss", first)  # evaluated on the held-out text
    second = run_lm(tmp_path / "run", 20).stdout
    assert "Resumed from the checkpoint at step 10." in second and re.search(
        r"step 20: eval/loss [\d.]+  train", second
    )
    checkpoint = fs.CheckpointFileReader(tmp_path / "run").read(None)
    expected = dataclasses.replace(
        lm.Config(),
        steps=20,
        output_dir=str(tmp_path / "run"),
        steps_per_checkpoint=10,
        embed=16,
        heads=2,
        head_dim=8,
        mlp=32,
        layers=1,
        seq_len=16,
    )
    assert checkpoint.metadata == dataclasses.asdict(expected)
    assert list((tmp_path / "run").glob("events.out.tfevents.*"))
    show = subprocess.run(
        [sys.executable, "-m", "flaxstate", "show", str(tmp_path / "run")], capture_output=True, text=True, timeout=120
    ).stdout
    assert "target/Block_0/Dense_0/kernel" in show and "(embed, mlp)" in show and "(heads, kv, embed)" in show


def test_a_mesh_that_does_not_fit_the_devices_is_refused(tmp_path):
    result = run_lm(tmp_path / "run", 10, "--mesh", "data=1,fsdp=2", check=False)
    assert result.returncode != 0
    assert "--mesh data=1,fsdp=2 has 2 devices; this run has 1." in result.stderr
