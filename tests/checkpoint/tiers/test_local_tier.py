import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flaxstate_testing import deprecations, toy
from flaxstate_testing.checkpoints import assert_trees_equal, fresh_state, records

import flaxstate as fs
from flaxstate.checkpoint.stores.packed import step_numbers


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: fs.LocalTier("gs://bucket/run"), "LocalTier got 'gs://bucket/run', a gs:// URL"),
        (lambda: fs.LocalTier(None), "LocalTier directory must be a local path, got None"),
        (lambda: fs.LocalTier("/dev/shm/run", peers=-1), "LocalTier peers must be an int of at least 0, got -1"),
        (lambda: fs.LocalTier("/dev/shm/run", keep=0), "LocalTier keep must be a positive int, got 0"),
        (lambda: fs.LocalTier("/dev/shm/run", keep="2"), "LocalTier keep must be a positive int, got '2'"),
    ],
)
def test_a_bad_local_tier_is_refused_where_it_is_made(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_a_local_tier_is_a_frozen_value_with_an_absolute_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tier = fs.LocalTier("local", peers=1, keep=2)
    assert tier.directory == tmp_path / "local" and isinstance(tier.directory, Path)
    assert tier == fs.LocalTier(tmp_path / "local", 1, 2) and hash(tier) == hash(fs.LocalTier(tmp_path / "local", 1, 2))


def test_the_writer_and_the_reader_take_the_tier_as_they_take_its_keywords(tmp_path, caplog):
    # The same records through a writer given the tier and one given per_process=True, keep=2: the same steps
    # kept in each process's directory; the reader given the tier restores the newest from it.
    recs = records(n_steps=6, every=2)
    persistent = tmp_path / "run"
    with fs.CheckpointFileWriter(persistent) as writer:
        writer(recs[0])  # one step behind the local tiers
    tier = fs.LocalTier(tmp_path / "by_object", keep=2)
    with fs.CheckpointFileWriter(tier) as by_object:
        assert by_object.per_process
        for record in recs:
            by_object(record)
    with fs.CheckpointFileWriter(tmp_path / "by_keywords", keep=2, per_process=True) as by_keywords:
        for record in recs:
            by_keywords(record)
    kept = [step_numbers(tmp_path / name / "process-0") for name in ("by_object", "by_keywords")]
    assert kept[0] == kept[1] == [4, 6], kept
    reader = fs.CheckpointFileReader([tier, persistent])
    assert reader.local_dir == tier.directory
    with caplog.at_level(logging.INFO, logger="flaxstate"):
        restored = reader.restore(fresh_state())
    assert "from the local tier" in caplog.text and int(restored.step) == 6
    assert_trees_equal(restored, recs[-1].state)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"keep": 3}, r"got LocalTier\(.*keep=2\) and keep=3: the tier says 2"),
        ({"peers": 1}, r"got LocalTier\(.*peers=0.*\) and peers=1: the tier says 0"),
        ({"keep": 1}, r"got LocalTier\(.*keep=2\) and keep=1: the tier says 2"),  # the default's value, given
        ({"per_process": False}, r"got LocalTier\(.*\) and per_process=False: a LocalTier is saved per process"),
        ({"per_process": "false"}, r"per_process"),  # a string is refused as ever, beside a tier too
    ],
)
def test_a_writer_given_a_tier_and_keywords_that_say_otherwise_is_refused_before_the_directory_is_touched(
    tmp_path, given, message
):
    with pytest.raises(ValueError, match=message):
        fs.CheckpointFileWriter(fs.LocalTier(tmp_path / "local", keep=2), **given)
    assert not (tmp_path / "local").exists()


def test_a_writer_given_a_tier_and_per_process_true_is_that_tier(tmp_path):
    with fs.CheckpointFileWriter(fs.LocalTier(tmp_path / "local", keep=2), per_process=True) as writer:
        assert writer.per_process and "keep=2" in repr(writer)


def test_the_plan_counts_the_tier_s_host_memory_as_its_keywords_say(tmp_path):
    model = toy.ShardedMLP(width=64)  # logical axes: sharded over the plan's mesh, as a pod's model is
    data = [(np.ones((8, 4), np.float32), np.zeros((8,), np.float32))] * 2
    task = fs.TrainTask(
        apply=model.apply, optimizer=optax.adam(1e-3), loss=lambda y, t: jnp.mean((y - t) ** 2), data=data
    )
    options = {"target": "cpu:4", "mesh_shape": {"fsdp": 4}, "axis_rules": [("batch", "fsdp"), ("hidden", "fsdp")]}
    tier = fs.LocalTier("/dev/shm/run", keep=2)
    by_object = fs.plan(model.init, task, local_dir=tier, **options)
    by_keywords = fs.plan(model.init, task, local_dir="/dev/shm/run", local_keep=2, **options)
    assert by_object.per_host == by_keywords.per_host
    one_step = fs.plan(model.init, task, local_dir="/dev/shm/run", **options).per_host["local_tier"]
    assert by_object.per_host["local_tier"] == 3 * one_step // 2  # keep + 1 steps: 3 against 2
    with pytest.raises(ValueError, match="plan got LocalTier.* and local_keep=3: the tier says 2"):
        fs.plan(model.init, task, local_dir=tier, local_keep=3, **options)
    with pytest.raises(ValueError, match="plan got LocalTier.* and local_keep=1: the tier says 2"):
        fs.plan(model.init, task, local_dir=tier, local_keep=1, **options)
    peered = fs.LocalTier("/dev/shm/run", peers=1)
    with pytest.raises(ValueError, match="plan got LocalTier.* and peers=0: the tier says 1"):
        fs.plan(model.init, task, local_dir=peered, peers=0, **options)


@pytest.mark.parametrize(
    ("keywords", "old"),
    [
        ({"keep": 2, "per_process": True}, "per_process= is"),
        ({"keep": 2, "per_process": True, "peers": 0}, "per_process=, peers= are"),
    ],
)
def test_the_writer_s_tier_keywords_warn_once_a_process_naming_the_tier_that_replaces_them(tmp_path, keywords, old):
    with deprecations.fresh() as warned:
        with fs.CheckpointFileWriter(tmp_path / "first", **keywords) as writer:
            assert writer.per_process and "keep=2" in repr(writer)  # they still work
        fs.CheckpointFileWriter(tmp_path / "second", **keywords).close()  # once a process
        fs.CheckpointFileWriter(fs.LocalTier(tmp_path / "third", keep=2)).close()  # the tier: no warning
    assert [str(warning.message) for warning in warned] == [
        f"CheckpointFileWriter's {old} deprecated and will be removed in a later release: give "
        f"CheckpointFileWriter(fs.LocalTier('{tmp_path / 'first'}', peers=0, keep=2)) instead."
    ]
    assert warned[0].filename == __file__  # the user's line, not flaxstate's


def test_the_plan_takes_the_tier_as_local_tier_and_its_old_keywords_warn(tmp_path):
    model = toy.ShardedMLP(width=64)
    data = [(np.ones((8, 4), np.float32), np.zeros((8,), np.float32))] * 2
    task = fs.TrainTask(
        apply=model.apply, optimizer=optax.adam(1e-3), loss=lambda y, t: jnp.mean((y - t) ** 2), data=data
    )
    options = {"target": "cpu:4", "mesh_shape": {"fsdp": 4}, "axis_rules": [("batch", "fsdp"), ("hidden", "fsdp")]}
    tier = fs.LocalTier("/dev/shm/run", keep=2)
    with deprecations.fresh() as warned:
        by_tier = fs.plan(model.init, task, local_tier=tier, **options)
    assert warned == []
    with deprecations.fresh() as warned:
        by_keywords = fs.plan(model.init, task, local_dir="/dev/shm/run", local_keep=2, **options)
        fs.plan(model.init, task, local_dir="/dev/shm/run", local_keep=2, **options)
    assert by_tier.per_host == by_keywords.per_host and by_tier.per_host["local_tier"] > 0
    assert [str(warning.message) for warning in warned] == [
        "plan's local_dir=, local_keep= are deprecated and will be removed in a later release: give "
        "local_tier=fs.LocalTier('/dev/shm/run', peers=0, keep=2) instead."
    ]
    for given in ({"local_dir": "/dev/shm/run"}, {"local_keep": 2}, {"peers": 0}):
        named = ", ".join(f"{name}=" for name in given)
        with pytest.raises(ValueError, match=rf"plan got local_tier=LocalTier\(.*\) and {named}: the LocalTier says"):
            fs.plan(model.init, task, local_tier=tier, **given, **options)
    with pytest.raises(ValueError, match=r"plan local_tier must be a fs.LocalTier or None, got '/dev/shm/run'"):
        fs.plan(model.init, task, local_tier="/dev/shm/run", **options)
