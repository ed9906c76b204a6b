"""Two devices as two processes (one CPU device each, gloo), on the shared cluster (flaxstate_testing/cluster.py).

Tier 1 (tests/README.md): scenarios on the shared cluster's processes, joined by `jax.distributed`. The others of
loop are in test_loop.py and test_loop_processes.py.
"""

import json

import numpy as np
import pytest
from flaxstate_testing import cluster


def train(tmp_path, name, model, n_processes, n_steps, global_batch=16, counts=False, **options):
    out = tmp_path / name
    out.mkdir()
    config = {"model": model, "n_steps": n_steps, "global_batch": global_batch, "out": str(out), "counts": counts}
    config.update(options)
    cluster.run("train", config, n_processes=n_processes, timeout=240)
    return [dict(np.load(out / f"process_{i}.npz")) for i in range(n_processes)]


@pytest.mark.parametrize("n_processes", [4])  # 2 processes against one device: the other tests here
def test_processes_equal_one_device_on_the_full_batch(tmp_path, n_processes):
    one = train(tmp_path, "one", "mlp", 1, n_steps=5, counts=True)[0]
    several = train(tmp_path, "several", "mlp", n_processes, n_steps=5, counts=True)
    for run in [one, *several]:  # an integer metric is averaged as a number, as the same count in float
        assert run["counts/close_int"] == run["counts/close_float"], run
    assert several[0]["counts/close_float"] == pytest.approx(
        one["counts/close_float"] / n_processes, abs=1 / n_processes
    )
    for key, value in one.items():
        if key.startswith("counts/"):
            continue
        np.testing.assert_allclose(several[0][key], value, rtol=2e-5, atol=2e-6, err_msg=key)
        for other in several[1:]:
            np.testing.assert_array_equal(several[0][key], other[key], err_msg=f"processes differ at {key}")


def test_batchnorm_running_means_are_averaged_across_devices(tmp_path):
    one = train(tmp_path, "one", "batchnorm", 1, n_steps=1)[0]
    two = train(tmp_path, "two", "batchnorm", 2, n_steps=1)
    key = "mutables/batch_stats/BatchNorm_0/mean"
    assert np.abs(one[key]).max() > 0
    np.testing.assert_allclose(two[0][key], one[key], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(two[0][key], two[1][key])


def test_dropout_masks_differ_per_device(tmp_path):
    two = train(tmp_path, "two", "dropout", 2, n_steps=1)
    grads = two[0]["grads/w"]
    # Device d draws one mask m_d for its whole batch, so its gradient is c_d * m_d; the average
    # (c_0 m_0 + c_1 m_1) / 2 takes two distinct magnitudes if the masks are equal, more if not.
    magnitudes = np.unique(np.round(np.abs(grads), 4))
    assert len(magnitudes) >= 3, magnitudes


def test_a_batch_poisoned_in_one_process_s_part_rolls_both_back_at_one_step_as_a_run_without_the_span(tmp_path):
    # Process 0's part of the batch of step 6 holds inf: both processes go back to step 4, skip steps 5 and 6,
    # and end as two processes that never had those batches, bit for bit.
    options = {"n_batches": 16, "n_steps_per_checkpoint": 4, "optimizer": "adam"}
    rolled = train(tmp_path, "rolled", "mlp", 2, 12, poison={"process": 0, "batch": 5}, rollback=True, **options)
    without = train(tmp_path, "without", "mlp", 2, 12, without=[4, 5], **options)
    made = [{"at_step": 6, "to_step": 4, "reason": "nonfinite", "skipped_steps": [5, 6]}]
    for i, (process, reference) in enumerate(zip(rolled, without, strict=True)):
        assert json.loads((tmp_path / "rolled" / f"rollbacks_{i}.json").read_text()) == made
        assert json.loads((tmp_path / "without" / f"rollbacks_{i}.json").read_text()) == []
        for key, value in reference.items():
            if key.startswith("params/"):
                np.testing.assert_array_equal(process[key], value, err_msg=key)


def test_an_nnx_module_s_own_dropout_stream_draws_a_mask_a_device_and_keeps_one_key(tmp_path):
    two = train(tmp_path, "two", "nnx_dropout", 2, n_steps=2)
    magnitudes = np.unique(np.round(np.abs(two[0]["grads/w"]), 4))
    assert len(magnitudes) >= 3, magnitudes  # equal masks on both devices give two magnitudes (see above)
    keys = [key for key in two[0] if key.startswith("mutables/rng_key/")]
    counts = [key for key in two[0] if key.startswith("mutables/rng_count/")]
    assert keys and counts, sorted(two[0])
    for key in keys + counts:  # the stream's state is one copy: the same on both processes
        np.testing.assert_array_equal(two[0][key], two[1][key], err_msg=key)
    one = train(tmp_path, "one", "nnx_dropout", 1, n_steps=2)[0]
    for key in keys + counts:  # the key as the module made it; the count advanced once a step, as on one device
        np.testing.assert_array_equal(two[0][key], one[key], err_msg=key)
