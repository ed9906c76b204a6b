"""Exact resume: a run stopped anywhere (even by kill -9) ends bit for bit as an uninterrupted one.

Tier 1 (tests/README.md): scenarios on the shared cluster's processes, joined by `jax.distributed`. The others of
resume are in test_resume_processes.py.
"""

import numpy as np
import pytest
from flaxstate_testing import cluster


def run(tmp_path, name, **config):
    out = tmp_path / f"{name}.npz"
    config = {"output_dir": str(tmp_path / name), "out": str(out), "every": 5, **config}
    outputs = cluster.run("resume", config, n_processes=1, timeout=180)
    return dict(np.load(out)), outputs[0]


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("data", ["list", "grain"])
def test_stop_and_resume_equals_an_uninterrupted_run(tmp_path, data):
    reference, _ = run(tmp_path, "reference", data=data, n_steps=20)
    first, output = run(tmp_path, "resumed", data=data, n_steps=10)
    assert "start 0" in output
    resumed, output = run(tmp_path, "resumed", data=data, n_steps=20)
    assert "start 10" in output
    assert_same(resumed, reference)
    assert not np.array_equal(first["target/Dense_0/kernel"], reference["target/Dense_0/kernel"])


def test_resume_with_steps_per_dispatch(tmp_path):
    reference, _ = run(tmp_path, "reference", data="grain", n_steps=20, per_dispatch=5)
    run(tmp_path, "resumed", data="grain", n_steps=10, per_dispatch=5)
    resumed, _ = run(tmp_path, "resumed", data="grain", n_steps=20, per_dispatch=5)
    assert_same(resumed, reference)
