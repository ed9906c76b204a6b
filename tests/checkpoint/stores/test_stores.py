"""The store protocol: both stores offer what a writer asks, chosen once by `open_store`, and behave alike."""

import time

import jax
import numpy as np
import pytest

from flaxstate.checkpoint import stores
from flaxstate.checkpoint.errors import CheckpointError
from flaxstate.checkpoint.stores.local import LocalStore
from flaxstate.checkpoint.stores.orbax_manager import CheckpointStore

STATE = {"target": {"w": np.arange(6, dtype=np.float32)}, "flax_mutables": {}, "state": {"step": np.int32(0)}}


def meta(step):
    return {"step": step, "run_id": "r", "rng": None, "data_position": None, "metrics": {}, "metadata": None}


@pytest.mark.parametrize("per_process", [False, True])
def test_open_store_picks_one_store_and_both_save_list_set_aside_prune_and_delete_alike(tmp_path, per_process):
    directory = stores.store_directory(tmp_path / "run", per_process=per_process)
    expected = tmp_path / "run" / f"process-{jax.process_index()}" if per_process else tmp_path / "run"
    assert directory.absolute() == expected.absolute()
    store = stores.open_store(directory, per_process=per_process, keep=10)
    assert isinstance(store, LocalStore if per_process else CheckpointStore)
    assert store.shared is (not per_process)
    with store:
        for step in (1, 2, 3, 4):
            store.save(step, STATE, meta(step), None)
            store.wait()
            time.sleep(0.01)  # the set-aside order is the directories' ctime
        assert store.steps() == [1, 2, 3, 4]
        assert store.read_meta(3)["step"] == 3
        with pytest.raises(CheckpointError, match="already holds step 4"):
            store.save(4, STATE, meta(4), None)  # nothing saved is ever replaced
        moved = [store.set_aside(step, ".superseded") for step in (1, 2, 3)]
        assert [path.name for path in moved] == ["1.superseded", "2.superseded", "3.superseded"]
        assert store.steps() == [4]
        removed = store.prune_aside(".superseded", keep=1)
        assert sorted(path.name for path in removed) == ["1.superseded", "2.superseded"]
        assert sorted(p.name for p in directory.iterdir() if "superseded" in p.name) == ["3.superseded"]
        store.delete([4])
        assert store.steps() == []


def test_a_best_writer_s_directory_is_its_subdirectory(tmp_path):
    assert stores.store_directory(tmp_path, per_process=False, subdir="best-loss") == tmp_path / "best-loss"
