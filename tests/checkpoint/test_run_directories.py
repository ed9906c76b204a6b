"""A directory holds one run: writers refuse to mix runs, readers tell damage from other faults."""

import json
import logging
import sys

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flaxstate_testing import loops, toy
from flaxstate_testing.checkpoints import saved_steps

import flaxstate as fs

MODEL = toy.BatchNormNet()
TX = optax.adam(1e-2)


def make_loop(init, n_steps=4, every=2, seed=0):
    return loops.make_loop(
        toy.batches(8, 8), model=MODEL, init=init, optimizer=TX, seed=seed, n_steps=n_steps, every=every
    )


def fresh_state():
    return fs.FlaxOptimTrainState.create(TX, MODEL.init(jax.random.key(3), np.ones((8, 4), np.float32)))


def train_into(directory, loop, **writer_options):
    with fs.CheckpointFileWriter(directory, keep=5, **writer_options) as writer:
        for record in loop:
            writer(record)
    return loop


def test_a_fresh_run_into_another_runs_directory_is_refused_and_nothing_is_lost(tmp_path):
    first = train_into(tmp_path, make_loop(MODEL.init))
    before = fs.CheckpointFileReader(tmp_path).read(fs.CheckpointFile(fresh_state(), 0))
    second = make_loop(MODEL.init, seed=1)  # a new init, not resumed
    assert second.run_id != first.run_id
    with fs.CheckpointFileWriter(tmp_path, keep=5) as writer:
        with pytest.raises(fs.CheckpointError) as error:
            writer(second.next_checkpoint())
    message = str(error.value)
    assert str(tmp_path) in message and "another run" in message and first.run_id in message
    assert "CheckpointFileReader" in message and "overwrite=True" in message
    after = fs.CheckpointFileReader(tmp_path).read(fs.CheckpointFile(fresh_state(), 0))
    assert saved_steps(tmp_path) == [2, 4] and after.run_id == first.run_id
    for a, b in zip(jax.tree.leaves(before.state), jax.tree.leaves(after.state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_overwrite_removes_the_other_runs_checkpoints_first(tmp_path, caplog):
    train_into(tmp_path, make_loop(MODEL.init, n_steps=6))
    second = make_loop(MODEL.init, seed=1)
    with caplog.at_level(logging.WARNING, logger="flaxstate"):
        train_into(tmp_path, second, overwrite=True)
    assert "removing steps [2, 4, 6]" in caplog.text
    assert saved_steps(tmp_path) == [2, 4]  # step 6 of the other run is gone too: it would have been the newest
    restored = fs.CheckpointFileReader(tmp_path).read(fs.CheckpointFile(fresh_state(), 0))
    assert restored.run_id == second.run_id and restored.step == 4


def test_a_resumed_run_writes_on_into_its_own_directory(tmp_path):
    first = train_into(tmp_path, make_loop(MODEL.init, n_steps=4))
    resumed = train_into(tmp_path, make_loop(fs.CheckpointFileReader(tmp_path, target=MODEL.init), n_steps=8))
    assert resumed.run_id == first.run_id
    assert saved_steps(tmp_path) == [2, 4, 6, 8]


def test_a_run_resumed_from_an_earlier_step_does_not_mix_two_histories(tmp_path):
    train_into(tmp_path, make_loop(MODEL.init, n_steps=6))
    earlier = make_loop(fs.CheckpointFileReader(tmp_path, target=MODEL.init, step=2), n_steps=6)
    with fs.CheckpointFileWriter(tmp_path, keep=5) as writer:
        with pytest.raises(fs.CheckpointError, match=r"already holds steps \[4, 6\] of this run.*overwrite=True"):
            writer(earlier.next_checkpoint())
    assert saved_steps(tmp_path) == [2, 4, 6]
    train_into(tmp_path, earlier, overwrite=True)
    assert saved_steps(tmp_path) == [2, 4, 6]
    assert fs.CheckpointFileReader(tmp_path).read(fs.CheckpointFile(fresh_state(), 0)).step == 6


def test_a_second_writer_on_one_directory_takes_over_from_the_idle_first_which_then_refuses(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="flaxstate")
    loop = make_loop(MODEL.init, n_steps=8)
    first = fs.CheckpointFileWriter(tmp_path, keep=2)
    first(loop.next_checkpoint())  # step 2, saving in the background
    second = fs.CheckpointFileWriter(tmp_path)  # a notebook cell run again
    assert saved_steps(tmp_path) == [2]  # the first's save was waited for
    assert f"takes over {tmp_path} from CheckpointFileWriter" in caplog.text and "idle" in caplog.text
    with pytest.raises(fs.CheckpointError, match=r"was replaced by CheckpointFileWriter\(.*saves nothing more"):
        first(loop.next_checkpoint())
    third = fs.CheckpointFileWriter(tmp_path / "." / "", keep=2)  # the same directory, spelled differently
    with pytest.raises(fs.CheckpointError, match="was replaced by"):
        second(loop.next_checkpoint())
    third(loop.next_checkpoint())
    # The best writers keep their own subdirectories: they do not collide with it.
    fs.LowestCheckpointFileWriter(tmp_path, metric="loss").close()
    third.close()
    assert saved_steps(tmp_path) == [2, 8]


def meta_file(step_dir):
    return step_dir / "meta" / "metadata"


def test_a_checkpoint_of_a_newer_format_is_a_clear_error_not_damage(tmp_path):
    train_into(tmp_path, make_loop(MODEL.init))
    meta = json.loads(meta_file(tmp_path / "4").read_text())
    meta["format_version"] = 99
    meta_file(tmp_path / "4").write_text(json.dumps(meta))
    current = fs.records.FORMAT_VERSION
    with pytest.raises(
        fs.CheckpointError,
        match=f"newer flaxstate \\(checkpoint format 99\\); this flaxstate reads formats 1 to {current}",
    ):
        fs.CheckpointFileReader(tmp_path).restore(fresh_state())  # not a fallback to step 2


def test_only_damage_makes_a_reader_fall_back(tmp_path, monkeypatch, caplog):
    train_into(tmp_path, make_loop(MODEL.init))
    original = ocp.CheckpointManager.restore

    def out_of_memory(self, step, *args, **kwargs):
        if step == 4 and "model" in kwargs.get("args", {}).keys():
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 96.00MiB.")
        return original(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", out_of_memory)
    with caplog.at_level(logging.WARNING, logger="flaxstate"):
        with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
            fs.CheckpointFileReader(tmp_path).restore(fresh_state())
    assert "damaged" not in caplog.text
    # A template of the wrong type is a bug of the caller, not damage either.
    monkeypatch.setattr(ocp.CheckpointManager, "restore", original)
    with pytest.raises(AttributeError):
        fs.CheckpointFileReader(tmp_path).restore(object())


def test_the_resumed_runs_changed_metadata_is_logged_key_by_key(tmp_path, caplog):
    train_into(tmp_path, make_loop(MODEL.init), metadata={"learning_rate": 0.01, "batch_size": 8, "model": {"w": 16}})
    resumed = make_loop(fs.CheckpointFileReader(tmp_path, target=MODEL.init), n_steps=6)
    with caplog.at_level(logging.WARNING, logger="flaxstate"):
        train_into(tmp_path, resumed, metadata={"learning_rate": 0.003, "batch_size": 8, "model": {"w": 32}})
    assert "metadata differs from the checkpoint at step 4" in caplog.text
    assert "learning_rate: 0.01 -> 0.003" in caplog.text and "model/w: 16 -> 32" in caplog.text
    assert "batch_size" not in caplog.text


def test_the_hint_for_a_missing_step_fits_a_reader_with_a_target(tmp_path):
    with pytest.raises(fs.CheckpointError) as error:
        fs.CheckpointFileReader(tmp_path, target=MODEL.init, step=7).read(fs.CheckpointFile(fresh_state(), 0))
    assert "drop step=" in str(error.value) and "give the reader target" not in str(error.value)


def test_silent_fresh_starts_and_no_op_resumes_are_logged(tmp_path, capsys):
    task = fs.TrainTask(apply=MODEL.apply, optimizer=TX, loss=toy.mse, data=toy.batches(8, 8))
    reader = fs.LowestCheckpointFileReader(tmp_path, metric="los", target=MODEL.init)  # a typo in the metric
    loop = fs.TrainLoop(reader, task, jax.random.key(0), n_steps=4, n_steps_per_checkpoint=2)
    out = capsys.readouterr().out
    assert "No checkpoint found by LowestCheckpointFileReader(" in out and "metric='los'" in out
    assert "training starts from step 0" in out
    train_into(tmp_path, loop)
    capsys.readouterr()
    past = fs.TrainLoop(fs.CheckpointFileReader(tmp_path, target=MODEL.init), task, jax.random.key(0), n_steps=3)
    assert past.next_checkpoint() is None
    out = capsys.readouterr().out
    assert "Resumed from the checkpoint at step 4" in out
    assert "step 4 is at or past n_steps (3): nothing to train" in out


def test_more_steps_on_resume_are_said_once_as_information_and_other_changes_still_warn(tmp_path, caplog, monkeypatch):
    # README's `make demo STEPS=1000`: the step count in the metadata and the command line that carries it.
    monkeypatch.setattr(sys, "argv", ["digits.py", "--steps", "4", "--lr=0.01"])
    train_into(tmp_path, make_loop(MODEL.init), metadata={"steps": 4, "lr": 0.01})
    monkeypatch.setattr(sys, "argv", ["digits.py", "--steps", "6", "--lr=0.01"])
    resumed = make_loop(fs.CheckpointFileReader(tmp_path, target=MODEL.init), n_steps=6)
    with caplog.at_level(logging.INFO, logger="flaxstate"):
        train_into(tmp_path, resumed, metadata={"steps": 6, "lr": 0.01})
    said = [record for record in caplog.records if "goes on" in record.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO and "steps: 4 -> 6" in said[0].getMessage()
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING], caplog.text
    caplog.clear()
    monkeypatch.setattr(sys, "argv", ["digits.py", "--steps", "8", "--lr=0.02"])
    again = make_loop(fs.CheckpointFileReader(tmp_path, target=MODEL.init), n_steps=8)
    with caplog.at_level(logging.INFO, logger="flaxstate"):
        train_into(tmp_path, again, metadata={"steps": 8, "lr": 0.02})
    warned = "\n".join(record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING)
    assert "lr: 0.01 -> 0.02" in warned and "'--lr=0.01' -> '--lr=0.02'" in warned, warned
    assert "steps: 6 -> 8" not in warned and "'6' -> '8'" not in warned, warned
