"""The local tier in one process: what a step holds, when it restores, and what it refuses.

The processes' agreement and kill -9 restarts are in `tiers/test_restart_processes.py` (two gloo processes);
FSDP's parts in `tests/training/test_sharded_loop_joined.py`.
"""

import json
import logging
import re
import shutil

import jax
import numpy as np
import pytest
from flaxstate_testing import toy
from flaxstate_testing.loops import make_loop

import flaxstate as fs
from flaxstate import tree_paths
from flaxstate.checkpoint.stores.local import LocalStore, process_directory


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
    tree = stored.read(12, template, with_optimizer=True).state_dict
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
    assert "meta.json is not valid JSON" in caplog.text
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


def test_a_new_experiment_never_restores_another_run_s_local_steps_and_says_so(tmp_path, caplog):
    local_dir, _, first = train(tmp_path)  # experiment 1: local steps 8 and 12, persistent step 4
    reader = fs.CheckpointFileReader([local_dir, tmp_path / "experiment-2"], target=toy.MLP().init)
    second = make_loop(n_steps=12, init=reader)
    assert second.step == 0 and second.run_id != first.run_id
    said = caplog.text
    assert f"the local tier's step 12 is of run {first.run_id}" in said, said
    assert "the persistent directory is new" in said and "overwrite=True" in said, said
    with fs.CheckpointFileWriter(local_dir, keep=1, per_process=True) as local:
        local(second.next_checkpoint())  # the persistent directory defines the run: experiment 1's local steps are
    # stale cache, set aside (at most keep=1 of them) in one line, and experiment 2 saves beside them
    names = sorted(p.name for p in process_directory(local_dir).iterdir())
    assert names in (["12.other-run", "4"], ["4", "8.other-run"]), names
    assert "steps [8, 12] are of another run" in caplog.text and "set aside as 8.other-run, 12.other-run" in caplog.text


def test_a_persistent_directory_of_another_run_restores_its_own_step_not_the_newer_local_one(tmp_path, caplog):
    local_dir, _, first = train(tmp_path / "a")  # run A: local steps 8 and 12
    _, other_persistent, other = train(tmp_path / "b", n_steps=4)  # run B: persistent step 4
    loop = make_loop(n_steps=12, init=fs.CheckpointFileReader([local_dir, other_persistent], target=toy.MLP().init))
    assert loop.step == 4 and loop.run_id == other.run_id != first.run_id
    assert f"the persistent directory's checkpoints are of run {other.run_id}" in caplog.text, caplog.text


def test_a_local_step_restores_before_the_run_s_first_persistent_save_through_its_ledger(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="flaxstate")
    local_dir, persistent_dir, first = train(tmp_path)
    shutil.rmtree(persistent_dir / "4")  # as if killed before the first persistent save: the ledger alone names the run
    assert [p.name for p in persistent_dir.iterdir() if p.name.isdigit()] == []
    loop = make_loop(n_steps=16, init=fs.CheckpointFileReader([local_dir, persistent_dir], target=toy.MLP().init))
    assert loop.step == 12 and loop.run_id == first.run_id
    assert "restored step 12 from the local tier" in caplog.text


def read_bytes() -> int:
    """The bytes this process has read through read(2) and its kin so far (Linux's /proc/self/io)."""
    with open("/proc/self/io") as io_file:
        return next(int(line.split()[1]) for line in io_file if line.startswith("rchar:"))


def test_an_inference_state_restored_from_the_local_tier_reads_only_its_arrays_bytes(tmp_path):
    model = toy.MLP(width=16384)  # adam's two moments: the file is three times the parameters
    local_dir, persistent_dir = tmp_path / "local", tmp_path / "persistent"
    loop = make_loop(n_steps=4, every=4, model=model)
    with (
        fs.CheckpointFileWriter(local_dir, per_process=True) as local,
        fs.CheckpointFileWriter(persistent_dir) as persistent,
    ):
        for record in loop:
            persistent(local(record))
    persistent_steps = sorted(p.name for p in persistent_dir.iterdir() if p.name.isdigit())
    shutil.rmtree(persistent_dir / persistent_steps[-1])  # so that only the local tier holds step 4
    variables = model.init(jax.random.key(0), np.zeros((1, 4), np.float32))
    file_bytes = (process_directory(local_dir) / "4" / "arrays.bin").stat().st_size
    params_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(variables["params"]))
    reader = fs.CheckpointFileReader([local_dir, persistent_dir])
    before = read_bytes()
    restored = reader.restore(fs.InferenceState.create(variables))
    read = read_bytes() - before
    assert params_bytes < read < params_bytes + (file_bytes - params_bytes) // 2, (read, params_bytes, file_bytes)
    for path, value in flat_state(loop.state).items():
        if path.startswith("target/"):
            np.testing.assert_array_equal(
                np.asarray(tree_paths.flatten({"target": restored.params})[path]), value, err_msg=path
            )
