"""'/'-joined paths of a tree: flatten and unflatten, shapes, the structure diff, and renames by rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxstate import tree_paths

TREE = {"target": {"Dense_0": {"kernel": np.ones((2, 3), np.float32), "bias": np.zeros(3, np.float32)}}, "step": 4}


def test_flatten_names_every_leaf_by_its_path_and_unflatten_gives_the_tree_back():
    flat = tree_paths.flatten(TREE)
    assert sorted(flat) == ["step", "target/Dense_0/bias", "target/Dense_0/kernel"]
    assert flat["step"] == 4
    back = tree_paths.unflatten(flat)
    assert back["step"] == 4 and back["target"]["Dense_0"]["kernel"] is TREE["target"]["Dense_0"]["kernel"]
    assert tree_paths.flatten({"a": [1, 2]}) == {"a/0": 1, "a/1": 2}  # sequence indices are path parts


def test_shape_and_dtype_read_arrays_abstract_values_and_python_numbers():
    assert tree_paths.shape_and_dtype(np.ones((2, 3), np.float16)) == ((2, 3), np.dtype(np.float16))
    abstract = jax.ShapeDtypeStruct((5,), jnp.bfloat16)
    assert tree_paths.shape_and_dtype(abstract) == ((5,), np.dtype(jnp.bfloat16))
    shape, _ = tree_paths.shape_and_dtype(3)
    assert shape == ()


def test_diff_names_missing_unexpected_and_mismatched_paths():
    found = {"target": {"Dense_0": {"kernel": np.ones((2, 4), np.float32)}, "Dense_1": {"w": np.ones(1)}}, "step": 4}
    difference = tree_paths.diff(TREE, found)
    assert difference
    assert difference.missing == ("target/Dense_0/bias",)
    assert difference.unexpected == ("target/Dense_1/w",)
    assert difference.mismatched == ("target/Dense_0/kernel (expected float32[2, 3], found float32[2, 4])",)
    text = difference.describe()
    assert "target/Dense_0/bias" in text and "target/Dense_1/w" in text
    assert not tree_paths.diff(TREE, TREE)


def test_rename_applies_rules_in_order_or_a_function_and_refuses_two_paths_made_one():
    flat = tree_paths.flatten(TREE)
    renamed = tree_paths.rename(flat, {"Dense_0/": "Encoder_0/", "^target/Encoder": "target/Enc"})
    assert sorted(renamed) == ["step", "target/Enc_0/bias", "target/Enc_0/kernel"]
    assert sorted(tree_paths.rename(flat, str.upper)) == ["STEP", "TARGET/DENSE_0/BIAS", "TARGET/DENSE_0/KERNEL"]
    assert tree_paths.rename(flat, None) == flat
    with pytest.raises(ValueError, match="maps both 'target/Dense_0/bias' and 'target/Dense_0/kernel'"):
        tree_paths.rename(flat, {"(bias|kernel)$": "w"})
