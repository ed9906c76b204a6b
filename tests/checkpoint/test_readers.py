"""Readers: the newest complete step restored into the model's tree; damage passed over, renames, live writers."""

import dataclasses
import logging
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flaxstate_testing import toy
from flaxstate_testing.checkpoints import (
    MODEL,
    assert_trees_equal,
    damage_arrays,
    fresh_state,
    records,
)

import flaxstate as fs


class Wider(nn.Module):
    @nn.compact
    def __call__(self, x):
        train = self.is_mutable_collection("batch_stats")
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(1, name="Head")(x)[:, 0]


def test_reader_restores_the_newest_state_rng_and_metadata(tmp_path):
    @dataclasses.dataclass
    class Config:
        learning_rate: float = 0.01
        name: str = "mlp"

    writer = fs.CheckpointFileWriter(tmp_path, keep=3, metadata=Config())
    recs = records()
    for record in recs:
        writer(record)
    restored = fs.CheckpointFileReader(tmp_path).read(fs.CheckpointFile(state=fresh_state(), step=0))
    assert restored.step == 6 and restored.format_version == fs.records.FORMAT_VERSION
    assert_trees_equal(restored.state, recs[-1].state)
    assert restored.metadata == {"learning_rate": 0.01, "name": "mlp"}
    assert jax.random.key_impl(restored.rng) == jax.random.key_impl(recs[-1].rng)
    np.testing.assert_array_equal(jax.random.key_data(restored.rng), jax.random.key_data(recs[-1].rng))
    at_four = fs.CheckpointFileReader(tmp_path, step=4).restore(fresh_state())
    assert_trees_equal(at_four, recs[1].state)


def test_reader_ignores_an_incomplete_save(tmp_path):
    writer = fs.CheckpointFileWriter(tmp_path, keep=3)
    for record in records():
        writer(record)
    partial = tmp_path / "8.orbax-checkpoint-tmp-1234"
    shutil.copytree(tmp_path / "6", partial)
    (partial / "commit_success.txt").unlink(missing_ok=True)
    assert int(fs.CheckpointFileReader(tmp_path).restore(fresh_state()).step) == 6


def test_restoring_into_a_changed_model_names_what_differs(tmp_path):
    writer = fs.CheckpointFileWriter(tmp_path)
    writer(records(2, 2)[-1])
    with pytest.raises(fs.StateMismatchError) as error:
        fs.CheckpointFileReader(tmp_path).restore(fresh_state(Wider()))
    message = str(error.value)
    assert str(tmp_path) in message and "step 2" in message
    assert "missing (expected, not found): " in message and "target/Head/kernel" in message
    assert "unexpected (found, not expected): " in message and "target/Dense_1/kernel" in message
    assert "target/Dense_0/kernel (expected float32[4, 16], found float32[4, 8])" in message


def test_a_smaller_checkpoint_never_loads_silently_into_a_bigger_model(tmp_path):
    fs.CheckpointFileWriter(tmp_path)(records(2, 2, model=toy.MLP())[-1])
    with pytest.raises(
        fs.StateMismatchError, match=r"target/Dense_0/kernel \(expected float32\[4, 32\], found float32\[4, 16\]\)"
    ):
        fs.CheckpointFileReader(tmp_path).restore(fresh_state(toy.MLP(width=32)))


def test_rename_loads_a_checkpoint_of_an_earlier_layout(tmp_path):
    recs = records(2, 2)
    fs.CheckpointFileWriter(tmp_path)(recs[-1])

    class Renamed(nn.Module):
        @nn.compact
        def __call__(self, x):
            train = self.is_mutable_collection("batch_stats")
            x = nn.Dense(8, name="Encoder")(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            return nn.Dense(1)(x)[:, 0]

    restored = fs.CheckpointFileReader(tmp_path, rename={r"Dense_0/": "Encoder/", r"Dense_1/": "Dense_0/"}).restore(
        fresh_state(Renamed())
    )
    np.testing.assert_array_equal(restored.params["Encoder"]["kernel"], recs[-1].state.params["Dense_0"]["kernel"])
    np.testing.assert_array_equal(restored.params["Dense_0"]["kernel"], recs[-1].state.params["Dense_1"]["kernel"])


def test_inference_state_restores_without_reading_the_optimizer(tmp_path):
    recs = records(4, 2)
    fs.CheckpointFileWriter(tmp_path)(recs[-1])
    shutil.rmtree(tmp_path / "4" / "optimizer")
    inference = fs.InferenceState.create(MODEL.init(jax.random.key(3), np.ones((8, 4), np.float32)))
    restored = fs.CheckpointFileReader(tmp_path).restore(inference)
    assert int(restored.step) == 4
    assert_trees_equal(restored.params, recs[-1].state.params)
    assert_trees_equal(restored.flax_mutables, recs[-1].state.flax_mutables)
    # A training state needs the optimizer, which is gone: that checkpoint is damaged for it.
    with pytest.raises(fs.CheckpointError, match="every checkpoint .* is damaged"):
        fs.CheckpointFileReader(tmp_path).restore(fresh_state())


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, how, caplog):
    recs = records()
    writer = fs.CheckpointFileWriter(tmp_path, keep=3)
    for record in recs:
        writer(record)
    damage_arrays(tmp_path / "6", how)
    with caplog.at_level(logging.WARNING, logger="flaxstate"):
        restored = fs.CheckpointFileReader(tmp_path).restore(fresh_state())
    assert int(restored.step) == 4
    assert_trees_equal(restored, recs[1].state)
    assert f"{tmp_path}/6 is damaged" in caplog.text


def test_when_every_checkpoint_is_damaged_the_error_says_so(tmp_path):
    fs.CheckpointFileWriter(tmp_path)(records(2, 2)[-1])
    damage_arrays(tmp_path / "2", "delete")
    with pytest.raises(fs.CheckpointError, match=f"every checkpoint in {tmp_path} is damaged"):
        fs.CheckpointFileReader(tmp_path).restore(fresh_state())


def test_bad_directories_are_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(fs.CheckpointError, match=f"{missing} does not exist"):
        fs.CheckpointFileReader(missing).restore(fresh_state())
    with pytest.raises(fs.CheckpointError, match=f"{tmp_path} holds no checkpoint"):
        fs.CheckpointFileReader(tmp_path).restore(fresh_state())
    assert fs.CheckpointFileReader(missing, target=MODEL.init).read(fs.CheckpointFile(fresh_state(), 0)) is None
    junk = tmp_path / "junk"
    (junk / "3").mkdir(parents=True)
    (junk / "3" / "something.txt").write_text("not a checkpoint")
    with pytest.raises(fs.CheckpointError, match=f"{junk}"):
        fs.CheckpointFileReader(junk, target=MODEL.init).read(fs.CheckpointFile(fresh_state(), 0))
    fs.CheckpointFileWriter(tmp_path / "run")(records(2, 2)[-1])
    with pytest.raises(fs.CheckpointError, match="no checkpoint at step 7; it has steps \\[2\\]"):
        fs.CheckpointFileReader(tmp_path / "run", step=7).restore(fresh_state())


def test_format_1_checkpoints_are_upgraded_on_read(tmp_path):
    record = records(2, 2)[-1]
    manager = ocp.CheckpointManager(tmp_path, item_names=("state", "meta"))
    manager.save(
        2,
        args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(record.state.state_dict()),
            meta=ocp.args.JsonSave({"format_version": 1, "step": 2}),
        ),
    )
    manager.wait_until_finished()
    restored = fs.CheckpointFileReader(tmp_path).read(fs.CheckpointFile(fresh_state(), 0))
    assert restored.format_version == 1 and restored.step == 2
    assert_trees_equal(restored.state, record.state)


def test_restored_state_is_donated_without_a_copy(tmp_path):
    writer = fs.CheckpointFileWriter(tmp_path)
    writer(records(2, 2)[-1])
    restored = fs.CheckpointFileReader(tmp_path).restore(fresh_state())
    before = [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(restored.params)]
    grads = jax.tree.map(jnp.zeros_like, restored.params)
    updated = jax.jit(lambda s, g: s.apply_gradient(g), donate_argnums=0)(restored, grads)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(restored.params))
    after = [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(updated.params)]
    assert set(before) & set(after), "no restored buffer was reused by the donated update"
