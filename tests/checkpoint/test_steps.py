"""What a step is (`classify`), and the one retry policy (`read_first`, `retrying`), on both stores' real files."""

import json
import logging
import shutil

import numpy as np
import pytest

from flaxstate.checkpoint import steps, stores
from flaxstate.checkpoint.errors import CheckpointError
from flaxstate.checkpoint.steps import StepKind, VanishedStepError

STATE = {"target": {"w": np.arange(6, dtype=np.float32)}, "flax_mutables": {}, "state": {"step": np.int32(0)}}


def meta(step, run_id="r"):
    return {"step": step, "run_id": run_id, "rng": None, "data_position": None, "metrics": {}, "metadata": None}


def saved(tmp_path, per_process, steps_and_runs):
    directory = stores.store_directory(tmp_path / "run", per_process=per_process)
    store = stores.open_store(directory, per_process=per_process, keep=10)
    for step, run_id in steps_and_runs:
        store.save(step, STATE, meta(step, run_id), None)
        store.wait()
    store.close()
    return stores.open_store(directory, per_process=per_process, read_only=True)


def meta_file(store, step):
    local = store.directory / str(step) / "meta.json"
    return local if local.exists() else store.directory / str(step) / "meta" / "metadata"


@pytest.mark.parametrize("per_process", [False, True])
def test_classify_says_complete_another_run_damaged_foreign_vanishing_and_partial(tmp_path, per_process):
    with saved(tmp_path, per_process, [(1, "r"), (2, "other"), (3, "r"), (4, "r"), (5, "r")]) as store:
        assert steps.classify(store, 1, "r").kind is StepKind.COMPLETE
        assert steps.classify(store, 1, "r").meta["step"] == 1
        other = steps.classify(store, 2, "r")
        assert (other.kind, other.run_id) == (StepKind.ANOTHER_RUN, "other")
        assert steps.classify(store, 2).kind is StepKind.COMPLETE  # no run asked for

        meta_file(store, 3).write_text(json.dumps({**meta(3), "step": "ten", "format_version": 3}))
        damaged = steps.classify(store, 3, "r")
        assert damaged.kind is StepKind.DAMAGED
        assert "step is 'ten'" in damaged.why and str(meta_file(store, 3)) in damaged.why  # the field and the file

        meta_file(store, 4).write_text(json.dumps({**meta(4), "format_version": 99}))
        foreign = steps.classify(store, 4, "r")
        assert foreign.kind is StepKind.FOREIGN and "newer flaxstate" in foreign.why
        assert isinstance(foreign.error, CheckpointError)

        listed = store.steps()
        shutil.rmtree(store.directory / "5")  # listed, then deleted by a writer's rotation
        assert 5 in listed
        assert steps.classify(store, 5).kind is StepKind.VANISHING

        unfinished = store.directory / ("7.partial-123" if per_process else "7.orbax-checkpoint-tmp-123")
        unfinished.mkdir()
        assert [(s.step, s.kind) for s in steps.partial_steps(store)] == [(7, StepKind.PARTIAL)]


def test_classify_raises_what_is_not_damage_and_never_takes_it_for_a_step_state(tmp_path):
    class Failing:
        directory = tmp_path

        def read_meta(self, step):
            raise MemoryError("out of host memory")

    with pytest.raises(MemoryError):
        steps.classify(Failing(), 1)


@pytest.mark.parametrize("per_process", [False, True])
def test_read_first_passes_over_a_damaged_step_and_lists_again_when_one_vanishes(tmp_path, per_process, caplog):
    with saved(tmp_path, per_process, [(1, "r"), (2, "r"), (3, "r"), (4, "r")]) as store:
        meta_file(store, 4).write_text("{not json")
        deleted = []

        def read(step):
            if step == 3 and not deleted:  # a writer rotates step 3 away while it is read
                deleted.append(step)
                shutil.rmtree(store.directory / "3")
                raise VanishedStepError("step 3 was deleted while it was read")
            return store.read(step, None)

        damaged = {}
        with caplog.at_level(logging.WARNING, logger="flaxstate"):
            stored = steps.read_first(store.directory, lambda: store.steps()[::-1], read, damaged)
        assert stored.meta["step"] == 2
        np.testing.assert_array_equal(stored.state_dict["target"]["w"], STATE["target"]["w"])
        assert list(damaged) == [4] and deleted == [3]
        assert "4 is damaged" in caplog.text and "3 is damaged" not in caplog.text  # a vanished step is no damage


def test_read_first_names_every_damaged_step_and_raises_what_is_not_damage(tmp_path):
    with saved(tmp_path, False, [(1, "r"), (2, "r")]) as store:
        for step in (1, 2):
            meta_file(store, step).write_text("{not json")
        with pytest.raises(CheckpointError, match=r"every checkpoint .* is damaged(.|\n)*step 2: (.|\n)*step 1: "):
            steps.read_first(store.directory, lambda: store.steps()[::-1], store.read_meta, {})

        def out_of_memory(step):
            raise MemoryError("out of host memory")

        with pytest.raises(MemoryError):  # never a reason to go back in time to an older step
            steps.read_first(store.directory, lambda: [2, 1], out_of_memory, {})


def test_read_first_and_retrying_give_up_on_steps_that_keep_vanishing(tmp_path, monkeypatch):
    # 20 attempts at the least, and 30 s (on a clock that moves a second a look): a loaded machine's read lost
    # 20 races in 2 s to a writer that rotates as fast as it saves.
    (tmp_path / "3").mkdir()
    now = iter(range(10**6))
    monkeypatch.setattr(steps, "_now", lambda: next(now))
    calls = []

    def vanishing(step=None):
        calls.append(step)
        raise VanishedStepError("deleted meanwhile")

    with pytest.raises(CheckpointError, match="kept vanishing"):
        steps.read_first(tmp_path, lambda: [3], vanishing, {})
    assert steps.LISTING_ATTEMPTS < len(calls) < steps.LISTING_ATTEMPTS + steps.LISTING_SECONDS  # till 30 (fake) s
    calls.clear()
    monkeypatch.setattr(steps, "LISTING_SECONDS", 0.0)
    with pytest.raises(CheckpointError, match="kept vanishing"):
        steps.retrying(tmp_path, vanishing)
    assert len(calls) == steps.LISTING_ATTEMPTS
    with pytest.raises(CheckpointError, match="holds no complete flaxstate checkpoint"):
        steps.read_first(tmp_path / "empty", list, vanishing, {})
