"""A writer's claims, through the claims module: the survey of a directory, the rules both tiers share, the registry."""

import json
import logging

import numpy as np
import pytest

import flaxstate as fs
from flaxstate.checkpoint import claims, stores

STATE = {"target": {"w": np.arange(6, dtype=np.float32)}, "flax_mutables": {}, "state": {"step": np.int32(0)}}


def record(step, run_id="this", skipped=()):
    return fs.Checkpoint(
        state=None,
        grads=None,
        loss=0.0,
        n_completed_steps=1,
        elapsed_time=0.0,
        step=step,
        run_id=run_id,
        skipped_damaged=tuple(skipped),
    )


def store_with(tmp_path, runs, per_process=False):
    """A store holding step s of run r for each (s, r)."""
    directory = stores.store_directory(tmp_path / "run", per_process=per_process)
    store = stores.open_store(directory, per_process=per_process, keep=10)
    for step, run_id in runs:
        meta = {"step": step, "run_id": run_id, "rng": None, "data_position": None, "metrics": {}, "metadata": None}
        store.save(step, STATE, meta, None)
        store.wait()
    return store


@pytest.mark.parametrize("per_process", [False, True])
def test_the_survey_sorts_steps_into_another_run_s_this_run_s_ahead_and_damaged(tmp_path, per_process):
    with store_with(tmp_path, [(2, "other"), (4, "this"), (6, "this"), (8, "this")], per_process) as store:
        skipped = [str(store.directory / "8")]  # the run's reader found step 8 damaged
        found = claims.survey(store, record(6, skipped=skipped))
        assert found.others == [2] and found.run_of[2] == "other"
        assert found.ahead == [6] and found.damaged == [8]
        assert found.newest_own(record(6)) == 4


def test_a_shared_directory_refuses_another_run_and_this_run_ahead_and_overwrite_removes_them(tmp_path, caplog):
    with store_with(tmp_path, [(2, "other"), (4, "this"), (6, "this")]) as store:
        with pytest.raises(fs.CheckpointError, match=r"holds checkpoints of another run \(steps \[2\], run other\)"):
            claims.claim(store, record(4), overwrite=False, keep=3, writer="w")
        assert store.steps() == [2, 4, 6]  # nothing removed by a refusal
        claims.claim(store, record(4), overwrite=True, keep=3, writer="w")
        assert store.steps() == [] and "overwrite=True, removing steps [2, 4, 6]" in caplog.text
    with store_with(tmp_path / "b", [(4, "this"), (6, "this")]) as store:
        with pytest.raises(fs.CheckpointError, match=r"already holds steps \[6\] of this run"):
            claims.claim(store, record(5), overwrite=False, keep=3, writer="w")


def test_a_per_process_directory_sets_this_run_ahead_aside_keeping_at_most_keep(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="flaxstate")
    with store_with(tmp_path, [(4, "this"), (6, "this"), (8, "this")], per_process=True) as store:
        claims.claim(store, record(5), overwrite=False, keep=1, writer="w")
        assert store.steps() == [4]
        aside = sorted(path.name for path in store.directory.iterdir() if claims.SUPERSEDED in path.name)
        assert len(aside) == 1, aside  # keep=1: the oldest removed, with one line
        assert "set aside as 6.superseded, 8.superseded" in caplog.text and "kept at most" in caplog.text
        meta_file = store.directory / "4" / "meta.json"
        meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "run_id": "other"}))
        claims.claim(store, record(5), overwrite=False, keep=1, writer="w")  # a new experiment's local tier
        assert store.steps() == [] and (store.directory / "4.other-run").is_dir()
        assert "steps [4] are of another run (other), not this one (this" in caplog.text


def test_the_registry_refuses_a_second_writer_of_a_busy_one_and_overlapping_tiers_naming_both(tmp_path):
    with fs.CheckpointFileWriter(tmp_path / "persistent") as first:
        first.busy = True  # as while a call saves a record (another thread's)
        with pytest.raises(fs.CheckpointError, match="is already written by CheckpointFileWriter.*saving a record now"):
            claims.check_free(first.directory, description="second", output_dir=first.directory, per_process=False)
        first.busy = False
        inside = tmp_path / "persistent" / "local"
        with pytest.raises(fs.CheckpointError, match="overlap: the local tier .* is inside the persistent tier"):
            claims.check_free(inside, description="local", output_dir=inside, per_process=True)
    key = claims.check_free(tmp_path / "persistent", description="again", output_dir=tmp_path, per_process=False)
    assert key == str((tmp_path / "persistent").resolve())  # closed: free again
