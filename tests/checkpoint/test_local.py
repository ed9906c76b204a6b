"""The local tier in one process: what a step holds, when it restores, and what it refuses.

The processes' agreement and kill -9 restarts are in `test_tiers.py` (two gloo processes); FSDP's parts in
`tests/training/test_sharded_loop.py`.
"""

import json
import logging
import re

import jax
import numpy as np
import pytest
from flaxstate_testing import toy
from flaxstate_testing.loops import make_loop

import flaxstate as fs
from flaxstate import tree_paths
from flaxstate.checkpoint.local import LocalStore, process_directory


def train(tmp_path, n_steps=12, persistent_steps=(4,)):
    """A run with a local writer every record (4 steps) and a persistent one at `persistent_steps` only."""
    local_dir, persistent_dir = tmp_path / "local", tmp_path / "persistent"
    loop = make_loop(n_steps=n_steps, init=fs.CheckpointFileReader([local_dir, persistent_dir], target=toy.MLP().init))
    with (
        fs.CheckpointFileWriter(local_dir, keep=2, per_process=True) as local,
        fs.CheckpointFileWriter(persistent_dir, keep=2) as persistent,
    ):
        for record in loop:
            local(record)
            if record.step in persistent_steps:
                persistent(record)
    return local_dir, persistent_dir, loop


def flat_state(state):
    return {path: np.asarray(leaf) for path, leaf in tree_paths.flatten(state.state_dict()).items()}


def test_a_local_step_holds_this_process_s_arrays_and_names_its_run_step_and_layout(tmp_path):
    local_dir, _, loop = train(tmp_path)
    part = process_directory(local_dir)
    assert part == local_dir.absolute() / "process-0"
    assert sorted(p.name for p in part.iterdir()) == ["12", "8"]  # keep=2, and no partial directory left
    meta = json.loads((part / "12" / "meta.json").read_text())
    assert meta["step"] == 12 and meta["run_id"] == loop.run_id
    assert meta["process_index"] == 0 and meta["processes"] == 1
    assert meta["devices"] == [device.id for device in jax.local_devices()]
    assert meta["bytes"] == (part / "12" / "arrays.bin").stat().st_size
    stored = LocalStore(part, read_only=True)
    template = jax.device_put(loop.state).state_dict()
    tree = stored.read(12, stored.read_meta(12), template, with_optimizer=True).state_dict
    for path, value in flat_state(loop.state).items():
        np.testing.assert_array_equal(np.asarray(tree_paths.flatten(tree)[path]), value, err_msg=path)


def test_the_newest_tier_restores_and_a_resume_ends_as_a_straight_run(tmp_path, caplog):
    straight = make_loop(n_steps=20)
    list(straight)
    local_dir, persistent_dir, _ = train(tmp_path)  # local: 8, 12; persistent: 4
    caplog.set_level(logging.INFO, logger="flaxstate")
    resumed = make_loop(n_steps=20, init=fs.CheckpointFileReader([local_dir, persistent_dir], target=toy.MLP().init))
    assert resumed.step == 12
    assert "restored step 12 from the local tier" in caplog.text
    list(resumed)
    for path, value in flat_state(straight.state).items():
        np.testing.assert_array_equal(flat_state(resumed.state)[path], value, err_msg=path)


def test_a_persistent_step_as_new_restores_from_the_persistent_tier(tmp_path, caplog):
    local_dir, persistent_dir, _ = train(tmp_path, persistent_steps=(4, 12))
    caplog.set_level(logging.INFO, logger="flaxstate")
    reader = fs.CheckpointFileReader([local_dir, persistent_dir], target=toy.MLP().init)
    assert make_loop(n_steps=12, init=reader).step == 12
    assert "no newer than the persistent tier's 12" in caplog.text
    assert "WARNING" not in caplog.text


def test_a_damaged_persistent_step_does_not_hide_a_newer_local_one(tmp_path, caplog):
    local_dir, persistent_dir, _ = train(tmp_path, persistent_steps=(4, 12))
    (persistent_dir / "12" / "meta" / "metadata").write_text("{not json")
    caplog.set_level(logging.INFO, logger="flaxstate")
    reader = fs.CheckpointFileReader([local_dir, persistent_dir], target=toy.MLP().init)
    assert make_loop(n_steps=12, init=reader).step == 12
    assert "restored step 12 from the local tier" in caplog.text


def test_a_persistent_step_whose_arrays_are_truncated_does_not_hide_a_newer_local_one(tmp_path, caplog):
    straight = make_loop(n_steps=16)
    list(straight)
    local_dir, persistent_dir, _ = train(tmp_path, persistent_steps=(4, 12))  # local: 8, 12; persistent: 4, 12
    for array_file in (persistent_dir / "12").rglob("*"):
        if array_file.is_file() and array_file.parent.name == "d":  # every array file: its meta still reads
            with open(array_file, "r+b") as handle:
                handle.truncate(array_file.stat().st_size // 2)
    caplog.set_level(logging.INFO, logger="flaxstate")
    reader = fs.CheckpointFileReader([local_dir, persistent_dir], target=toy.MLP().init)
    loop = make_loop(n_steps=16, init=reader)
    assert loop.step == 12  # the local step, not the persistent step 4
    assert "restored step 12 from the local tier" in caplog.text
    with (
        fs.CheckpointFileWriter(local_dir, keep=2, per_process=True) as local,
        fs.CheckpointFileWriter(persistent_dir, keep=2) as persistent,
    ):
        for record in loop:
            persistent(local(record))
    assert "12.damaged" in {p.name for p in persistent_dir.iterdir()}  # set aside, not a refusal
    for path, value in flat_state(straight.state).items():
        np.testing.assert_array_equal(flat_state(loop.state)[path], value, err_msg=path)


def test_steps_set_aside_by_fallbacks_are_kept_at_most_keep_and_the_oldest_removed_with_one_line(tmp_path, caplog):
    local_dir, persistent_dir, _ = train(tmp_path)  # local: 8, 12; persistent: 4
    part = process_directory(local_dir)
    for restart in range(3):  # each restart falls back to the persistent step 4, past the local 8 and 12
        loop = make_loop(n_steps=12, init=fs.CheckpointFileReader(persistent_dir, target=toy.MLP().init))
        assert loop.step == 4
        with fs.CheckpointFileWriter(local_dir, keep=2, per_process=True) as local:
            for record in loop:
                local(record)
        aside = sorted(p.name for p in part.iterdir() if ".superseded" in p.name)
        assert len(aside) == 2, (restart, aside)
    assert aside == ["12.superseded", "8.superseded"]  # the third restart's (the names of removed ones are free)
    assert sorted(p.name for p in part.iterdir() if p.name.isdigit()) == ["12", "8"]
    assert caplog.text.count("removed the oldest steps set aside (2 kept at most): ") == 2


def test_tiers_that_are_one_directory_or_nested_are_refused_naming_both(tmp_path):
    persistent, local = tmp_path / "run", tmp_path / "run" / "local"
    for dirs, how in [
        ([persistent, persistent], "same directory"),
        ([local, persistent], f"local tier {local} is inside the persistent tier {persistent}"),
        ([persistent, local], f"persistent tier {local} is inside the local tier {persistent}"),
        ([tmp_path / "x" / ".." / "run", persistent], "same directory"),
    ]:
        with pytest.raises(ValueError, match=re.escape(how)):
            fs.CheckpointFileReader(dirs)
    fs.CheckpointFileReader([tmp_path / "local", persistent])  # siblings are apart
    with fs.CheckpointFileWriter(persistent):
        for local_dir in (persistent, local, tmp_path):
            with pytest.raises(
                fs.CheckpointError, match=re.escape(f"and the open CheckpointFileWriter('{persistent}'")
            ):
                fs.CheckpointFileWriter(local_dir, per_process=True)
        fs.CheckpointFileWriter(tmp_path / "local", per_process=True).close()
    with fs.CheckpointFileWriter(local, per_process=True):
        with pytest.raises(fs.CheckpointError, match="inside the persistent tier"):
            fs.CheckpointFileWriter(persistent)
    fs.CheckpointFileWriter(persistent).close()  # the local writer closed: the directory is free again


def test_a_damaged_local_step_is_passed_over_with_a_warning_and_set_aside_by_the_writer(tmp_path, caplog):
    local_dir, persistent_dir, _ = train(tmp_path)
    (process_directory(local_dir) / "12" / "meta.json").write_text('{"step": 12, "format_')
    reader = fs.CheckpointFileReader([local_dir, persistent_dir], target=toy.MLP().init)
    loop = make_loop(n_steps=16, init=reader)
    assert loop.step == 8  # the older local step, still newer than the persistent step 4
    assert "meta.json cannot be read as JSON" in caplog.text
    with fs.CheckpointFileWriter(local_dir, keep=2, per_process=True) as local:
        for record in loop:
            local(record)
    names = sorted(p.name for p in process_directory(local_dir).iterdir())
    assert "12.damaged" in names and "16" in names, names


def test_an_empty_local_tier_with_no_persistent_step_starts_fresh_quietly(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="flaxstate")
    reader = fs.CheckpointFileReader([tmp_path / "local", tmp_path / "persistent"], target=toy.MLP().init)
    assert reader.read(None) is None
    assert make_loop(init=reader).step == 0
    assert "tier" not in caplog.text


def test_tiers_are_a_list_of_two_and_only_for_the_newest_reader(tmp_path):
    with pytest.raises(ValueError, match=r"\[local_dir, persistent_dir\]"):
        fs.CheckpointFileReader([tmp_path / "a"])
    with pytest.raises(ValueError, match="not tiers"):
        fs.LowestCheckpointFileReader([tmp_path / "a", tmp_path / "b"], metric="loss")
    reader = fs.CheckpointFileReader([tmp_path / "a", tmp_path / "b"])
    assert repr(reader) == f"CheckpointFileReader([{str(tmp_path / 'a')!r}, {str(tmp_path / 'b')!r}])"
    assert "per_process=True" in repr(fs.CheckpointFileWriter(tmp_path / "c", per_process=True))
