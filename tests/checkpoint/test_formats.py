"""Formats as objects: each version's items, how its paths split and join, and what an older version reads as."""

import jax
import numpy as np
import pytest

from flaxstate import tree_paths
from flaxstate.checkpoint import formats
from flaxstate.checkpoint.layout import LEGACY_RUN_ID, LEGACY_STATE, MODEL, OPTIMIZER
from flaxstate.records import FORMAT_VERSION

STATE = {
    "target": {"Dense_0": {"kernel": np.ones((2, 3), np.float32)}},
    "flax_mutables": {"batch_stats": {"mean": np.zeros(3, np.float32)}},
    "state": {"step": np.int32(4), "param_states": {"0": {"mu": np.zeros(3, np.float32)}}},
}


def test_the_current_format_is_the_one_records_name_and_every_older_one_is_read():
    assert formats.CURRENT.version == FORMAT_VERSION
    assert sorted(formats.FORMATS) == list(range(1, FORMAT_VERSION + 1))
    assert [item.name for item in formats.FORMATS[1].items] == [LEGACY_STATE]
    assert [item.name for item in formats.CURRENT.items] == [MODEL, OPTIMIZER]
    assert formats.of({"format_version": 2}) is formats.FORMATS[2]


def test_a_save_splits_the_state_dict_into_its_items_and_a_read_joins_them_back():
    items = formats.CURRENT.save_items(STATE, lambda part: part)
    assert set(items) == {MODEL, OPTIMIZER}
    assert set(items[MODEL]) == {"target", "flax_mutables"}
    assert set(items[OPTIMIZER]) == {"step", "param_states"}  # the optimizer's item holds state's entries
    flat_items = {name: tree_paths.flatten(part) for name, part in items.items()}
    assert formats.CURRENT.join(flat_items, with_optimizer=True) == tree_paths.flatten(STATE)
    without = formats.CURRENT.join(flat_items, with_optimizer=False)
    assert without == {k: v for k, v in tree_paths.flatten(STATE).items() if not k.startswith("state/")}
    assert [item.name for item in formats.CURRENT.read_items(with_optimizer=False)] == [MODEL]


@pytest.mark.parametrize("version", [1, 3])
def test_paths_split_into_their_items_and_the_layout_is_the_state_dict_s(version):
    stored = formats.FORMATS[version]
    split = stored.split({"target/Dense_0/kernel": 1, "state/param_states/0/mu": 2})
    if version == 1:
        assert split == {LEGACY_STATE: {"target/Dense_0/kernel": 1, "state/param_states/0/mu": 2}}
    else:
        assert split == {MODEL: {"target/Dense_0/kernel": 1}, OPTIMIZER: {"param_states/0/mu": 2}}
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), STATE)
    trees = stored.save_items(shapes, lambda part: part)
    layout = stored.layout(trees, with_optimizer=True, step=4)
    assert tree_paths.flatten(layout) == tree_paths.flatten(shapes)
    assert stored.layout(trees, with_optimizer=False, step=4)["state"] == {}


def test_a_step_missing_an_item_is_damage_that_names_it():
    trees = formats.CURRENT.save_items(STATE, lambda part: part)
    del trees[OPTIMIZER]
    with pytest.raises(FileNotFoundError, match="step 4 has no item optimizer"):
        formats.CURRENT.layout(trees, with_optimizer=True, step=4)
    assert "target" in formats.CURRENT.layout(trees, with_optimizer=False, step=4)  # a model-only read needs none


def test_an_older_format_s_meta_reads_with_the_run_id_it_lacks():
    assert formats.FORMATS[2].upgrade({"step": 1})["run_id"] == LEGACY_RUN_ID
    assert formats.FORMATS[1].upgrade({"step": 1, "run_id": "kept"})["run_id"] == "kept"
    assert "run_id" not in formats.CURRENT.upgrade({"step": 1})
    assert not formats.FORMATS[1].partial_reads and formats.CURRENT.partial_reads
