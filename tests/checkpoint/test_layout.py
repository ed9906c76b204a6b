"""The JSON forms of what a step's meta holds: random keys, metadata, and which directories hold steps."""

import dataclasses

import jax
import numpy as np
import pytest

from flaxstate.checkpoint import layout
from flaxstate.checkpoint.errors import CheckpointError


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_a_random_key_survives_its_json_form_with_its_implementation(impl):
    key = jax.random.key(7, impl=impl)
    decoded = layout.decode_rng(layout.encode_rng(key))
    assert str(jax.random.key_impl(decoded)) == str(jax.random.key_impl(key))
    np.testing.assert_array_equal(jax.random.key_data(decoded), jax.random.key_data(key))
    assert layout.encode_rng(None) is None and layout.decode_rng(None) is None


def test_metadata_becomes_json_from_a_dict_or_a_dataclass_and_anything_else_is_refused():
    @dataclasses.dataclass
    class Config:
        lr: float = 0.1
        layers: tuple = (1, 2)

    assert layout.to_json(Config()) == {"lr": 0.1, "layers": [1, 2]}
    assert layout.to_json({"a": None}) == {"a": None}
    with pytest.raises(CheckpointError, match="metadata must be JSON-serializable"):
        layout.to_json({"array": np.ones(2)})


def test_only_a_directory_with_step_folders_holds_checkpoints(tmp_path):
    assert layout.is_empty_or_missing(tmp_path / "nope")
    assert layout.is_empty_or_missing(tmp_path)
    (tmp_path / "best-loss").mkdir()
    assert layout.is_empty_or_missing(tmp_path)
    (tmp_path / "12").mkdir()
    assert not layout.is_empty_or_missing(tmp_path)
