"""A batch's forms and checks: normalized to (inputs, targets), divided over devices and microbatches, stacked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxstate.training import batching

X, Y = np.ones((8, 3), np.float32), np.zeros(8, np.int32)


def test_every_accepted_form_normalizes_to_two_tuples_and_others_are_named():
    assert batching.normalize((X, Y), "TrainTask") == ((X,), (Y,))
    assert batching.normalize(((X, X), (Y,)), "TrainTask") == ((X, X), (Y,))
    assert batching.normalize(((X,), ()), "TrainTask") == ((X,), ())
    assert batching.normalize([X, [Y]], "TrainTask") == ((X,), (Y,))
    for bad, described in [
        ({"x": X}, r"\{'x': array\[8, 3\]\}"),
        ((X, "label"), r"\(array\[8, 3\], str\)"),
        (((), (Y,)), r"\(\(\)"),
    ]:
        with pytest.raises(ValueError, match=rf"EvalTask.data yielded a batch of the wrong structure: {described}"):
            batching.normalize(bad, "EvalTask")
    # Whole (NNX's loss_fn(model, batch)): any tree of arrays with a batch axis, as it came; else named.
    assert batching.normalize({"image": X, "label": Y}, "TrainTask", whole=True) == (({"image": X, "label": Y},), ())
    with pytest.raises(ValueError, match=r"A batch for loss_fn\(model, batch\) is any tree of arrays"):
        batching.normalize({"image": X, "label": "seven"}, "TrainTask", whole=True)


def test_k_whole_batches_stack_leaf_by_leaf_and_unequal_ones_are_named():
    stacked = batching.stack([(({"image": X, "label": Y},), ())] * 3, first_step=1)
    assert stacked[0][0]["image"].shape == (3, 8, 3) and stacked[0][0]["label"].shape == (3, 8)
    with pytest.raises(ValueError, match="steps 1-2"):
        batching.stack([(({"image": X},), ()), (({"image": X[:4]},), ())], first_step=1)


def test_a_batch_must_divide_over_the_devices_and_then_into_microbatches():
    batching.check_divisible(((X,), (Y,)), 4, "TrainTask", n_microbatches=2)
    with pytest.raises(ValueError, match="batch of size 8, which does not divide by the 3 local devices"):
        batching.check_divisible(((X,), (Y,)), 3, "TrainTask")
    with pytest.raises(ValueError, match=r"2 examples a device \(4 local devices\).*n_microbatches=4"):
        batching.check_divisible(((X,), (Y,)), 4, "TrainTask", n_microbatches=4)
    with pytest.raises(ValueError, match="batch of size a scalar"):
        batching.check_divisible(((np.float32(1.0),), ()), 1, "TrainTask")


def test_k_batches_stack_along_a_leading_axis_and_a_ragged_one_names_its_step():
    stacked = batching.stack([((X,), (Y,)), ((X * 2,), (Y,))], first_step=10)
    assert stacked[0][0].shape == (2, 8, 3) and stacked[1][0].shape == (2, 8)
    np.testing.assert_array_equal(stacked[0][0][1], X * 2)
    half, small = X.astype(jnp.bfloat16), Y.astype(np.int8)  # the stack keeps each leaf's dtype, as np.stack
    three = batching.stack([((half, X), (small,)), ((half + 1, X), (small,)), ((half, X * 3), (small + 1,))], 1)
    expected_leaves = ([half, half + 1, half], [X, X, X * 3], [small, small, small + 1])
    for got, leaves in zip(jax.tree.leaves(three), expected_leaves, strict=True):
        expected = np.stack(leaves)
        assert got.dtype == expected.dtype and got.shape == expected.shape and np.array_equal(got, expected)
    with pytest.raises(ValueError, match=r"step 11 has \[\[3, 8\], \[8\]\]"):  # the same size, transposed
        batching.stack([((X,), (Y,)), ((X.T.copy(),), (Y,))], first_step=10)
    with pytest.raises(ValueError, match=r"steps 10-11\): step 10 has .* step 11 has \[\[4, 3\], \[4\]\]"):
        batching.stack([((X,), (Y,)), ((X[:4],), (Y[:4],))], first_step=10)


def test_the_global_spec_scales_the_first_axis_and_one_process_keeps_batches_on_the_host():
    spec = batching.global_spec(((X,), (Y,)), 32)
    assert spec[0][0] == jax.ShapeDtypeStruct((32, 3), np.float32) and spec[1][0].shape == (32,)
    mesh = batching.mesh_of(None)
    assert batching.local_device_count(mesh) == jax.local_device_count()
    assert batching.to_devices(((X,), (Y,)), mesh, stacked=False) == ((X,), (Y,))  # the compiled step places it
