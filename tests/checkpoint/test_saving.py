"""A store's one background save: its failure raised once naming the step, and steps set aside and pruned."""

import time

import jax.numpy as jnp
import numpy as np
import pytest

from flaxstate.checkpoint import saving
from flaxstate.checkpoint.errors import CheckpointSaveError
from flaxstate.checkpoint.stores.local import LocalStore


def meta(step):
    return {"step": step, "run_id": "r", "rng": None, "data_position": None, "metrics": {}, "metadata": None}


def test_a_background_save_s_failure_is_raised_by_the_next_wait_naming_its_step_and_once(tmp_path):
    store = LocalStore(tmp_path, keep=3)  # a SaveSlot whose save runs in a thread of its own
    deleted = jnp.ones(3)
    deleted.delete()  # donated or deleted before the save read it
    store.save(7, {"target": {"w": deleted}, "flax_mutables": {}, "state": {}}, meta(7))
    store.settle()  # waits, and keeps the failure for wait()
    with pytest.raises(CheckpointSaveError, match=r"step 7 to .* failed in the background \(its arrays were donated"):
        store.wait()
    assert store.steps() == [] and store.unfinished() == []  # what the failed save left is removed
    store.wait()  # raised once
    store.save(8, {"target": {"w": np.ones(3)}, "flax_mutables": {}, "state": {}}, meta(8))
    store.close()
    assert store.steps() == [8] and store.completed is not None and store.completed[0] == 8


def test_a_step_set_aside_gets_a_free_name_and_pruning_keeps_the_newest(tmp_path):
    for step in (1, 2):
        (tmp_path / str(step)).mkdir()
    first = saving.aside(tmp_path / "1", ".damaged")
    (tmp_path / "1").rename(first)
    (tmp_path / "1").mkdir()
    second = saving.aside(tmp_path / "1", ".damaged")
    assert (first.name, second.name) == ("1.damaged", "1.damaged-2")
    (tmp_path / "1").rename(second)
    time.sleep(0.01)
    (tmp_path / "2").rename(saving.aside(tmp_path / "2", ".damaged"))
    (tmp_path / "3.superseded").mkdir()
    removed = saving.prune_aside(tmp_path, ".damaged", keep=1)
    assert sorted(path.name for path in removed) == ["1.damaged", "1.damaged-2"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["2.damaged", "3.superseded"]
    assert saving.prune_aside(tmp_path / "missing", ".damaged", keep=0) == []


def test_a_failed_clean_up_does_not_replace_the_save_s_own_error(tmp_path):
    """An endpoint gone for good fails the save and then its clean-up: the save's error names the step and place."""

    class Unreachable(LocalStore):
        def remove_unfinished(self, step=None):
            raise ConnectionError("Could not connect to the endpoint URL: 'http://127.0.0.1:9/'")

    store = Unreachable(tmp_path, keep=3)
    deleted = jnp.ones(3)
    deleted.delete()
    store.save(7, {"target": {"w": deleted}, "flax_mutables": {}, "state": {}}, meta(7))
    with pytest.raises(CheckpointSaveError) as raised:
        store.wait()
    message = str(raised.value)
    assert message.startswith(f"saving the checkpoint of step 7 to {store.directory} failed in the background")
    assert "removing its partial files failed too (ConnectionError: Could not connect" in message
    assert isinstance(raised.value.__cause__, ConnectionError)
    assert raised.value.__cause__.__context__ is not None  # the save's own failure, behind the clean-up's
