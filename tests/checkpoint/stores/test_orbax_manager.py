"""The orbax directory store through its own interface: save, list, read whole or by path, into any template."""

import shutil

import jax
import numpy as np
import pytest

from flaxstate.checkpoint.errors import CheckpointError
from flaxstate.checkpoint.stores.orbax_manager import CheckpointStore
from flaxstate.train_state import StateMismatchError

STATE = {
    "target": {"Dense_0": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3)}},
    "flax_mutables": {"stats": {"mean": np.ones(3, np.float32)}},
    "state": {"step": np.int32(5), "param_states": {"mu": np.full(3, 2.0, np.float32)}},
}


def meta(step):
    return {"step": step, "run_id": "r", "rng": None, "data_position": None, "metrics": {"eval": {"loss": 0.5}}}


@pytest.fixture
def store(tmp_path):
    with CheckpointStore(tmp_path, keep=3) as writing:
        for step in (5, 10):
            writing.save(step, STATE, meta(step))
            writing.wait()
        with pytest.raises(CheckpointError, match="already holds step 10; a saved checkpoint is never replaced"):
            writing.save(10, STATE, meta(10))
    with CheckpointStore(tmp_path, read_only=True) as reading:
        yield reading


def test_a_step_reads_back_whole_as_numpy_or_into_a_template_s_shardings(store):
    assert store.steps() == [5, 10]
    stored = store.read(10, None)
    assert stored.meta["step"] == 10 and stored.meta["format_version"] == 3 and stored.meta["run_id"] == "r"
    for got, want in zip(jax.tree.leaves(stored.state_dict), jax.tree.leaves(STATE), strict=True):
        np.testing.assert_array_equal(got, want)
    template = jax.tree.map(jax.numpy.asarray, STATE)
    placed = store.read(10, template).state_dict
    kernel = placed["target"]["Dense_0"]["kernel"]
    assert isinstance(kernel, jax.Array) and kernel.sharding == template["target"]["Dense_0"]["kernel"].sharding


def test_a_model_read_never_opens_the_optimizer_and_arrays_read_alone_by_path(store):
    shutil.rmtree(store.directory / "10" / "optimizer")
    model_only = store.read(10, None, with_optimizer=False).state_dict
    assert model_only["state"] == {} and "kernel" in model_only["target"]["Dense_0"]
    read = store.read_paths(5, ["target/Dense_0/kernel", "state/param_states/mu"])
    assert sorted(read) == ["state/param_states/mu", "target/Dense_0/kernel"]
    np.testing.assert_array_equal(read["state/param_states/mu"], STATE["state"]["param_states"]["mu"])
    with pytest.raises(CheckpointError, match="holds no array at target/Dense_1/kernel"):
        store.read_paths(5, ["target/Dense_1/kernel"])
    tree = store.stored_tree(5)
    assert tree["target"]["Dense_0"]["kernel"].shape == (2, 3)


def test_a_template_of_another_layout_is_named_path_by_path_and_rename_maps_old_paths(store):
    renamed = {**STATE, "target": {"Encoder_0": STATE["target"]["Dense_0"]}}
    with pytest.raises(
        StateMismatchError, match=r"(?s)missing.*target/Encoder_0/kernel.*unexpected.*target/Dense_0/kernel"
    ):
        store.read(5, renamed)
    read = store.read(5, renamed, rename={"Dense_0/": "Encoder_0/"}).state_dict
    np.testing.assert_array_equal(read["target"]["Encoder_0"]["kernel"], STATE["target"]["Dense_0"]["kernel"])


def test_unfinished_saves_are_listed_never_read_and_removed(store, tmp_path):
    (tmp_path / "15.orbax-checkpoint-tmp-1234").mkdir()
    assert [path.name for path in store.unfinished()] == ["15.orbax-checkpoint-tmp-1234"]
    assert store.steps() == [5, 10]
    assert [path.name for path in store.remove_unfinished(15)] == ["15.orbax-checkpoint-tmp-1234"]
    assert store.unfinished() == []
