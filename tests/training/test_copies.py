"""What records hold: host copies (the devices keep one copy of the state), valid as long as they are held."""

import collections
import gc

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flaxstate_testing import toy

import flaxstate as fs
from flaxstate.training import copies

MLP = toy.MLP()


class Wide(nn.Module):
    """The issue's model: an MLP 32-2048-2048-10, 48.5 MiB of state with adam."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(2048)(x))
        x = nn.relu(nn.Dense(2048)(x))
        return nn.Dense(10)(x)


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def device_bytes():
    """The largest bytes of live arrays in device memory on any one device (host-memory arrays not counted)."""
    per_device = collections.Counter()
    for array in jax.live_arrays():
        if array.sharding.memory_kind in (None, "device"):
            shard_bytes = int(np.prod(array.sharding.shard_shape(array.shape))) * array.dtype.itemsize
            for device in array.sharding.addressable_devices:
                per_device[device] += shard_bytes
    return max(per_device.values(), default=0)


def sampled(batches, samples):
    """Yields the batches in a cycle, noting the device bytes at each draw (the loop draws between dispatches)."""
    while True:
        for batch in batches:
            samples.append(device_bytes())
            yield batch


def wide_batches(n, seed):
    rng = np.random.RandomState(seed)
    return [(rng.randn(64, 32).astype(np.float32), rng.randint(0, 10, 64).astype(np.int32)) for _ in range(n)]


@pytest.mark.parametrize("per_dispatch", [1, 5])
def test_a_run_with_evaluation_and_checkpoints_holds_one_copy_of_the_state_on_the_devices(tmp_path, per_dispatch):
    gc.collect()  # what earlier tests left (a failed test's traceback holds its loop) is counted out
    model, samples, before = Wide(), [], device_bytes()
    task = fs.TrainTask(
        apply=model.apply,
        optimizer=optax.adam(1e-4),
        loss=cross_entropy,
        data=sampled(wide_batches(4, 0), samples),
    )
    loop = fs.TrainLoop(
        model.init,
        task,
        rng=0,
        n_steps=20,
        n_steps_per_checkpoint=5,
        n_steps_per_dispatch=per_dispatch,
        stdout=False,
    )
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(loop.state))
    assert 48 * 2**20 < state_bytes < 50 * 2**20
    evaluate = fs.EvalLoop(
        fs.EvalTask(apply=model.apply, metrics={"loss": cross_entropy}, data=sampled(wide_batches(2, 1), samples)),
        rng=1,
        n_steps=2,
    )
    with fs.CheckpointFileWriter(tmp_path / "run", keep=2) as writer:
        for checkpoint in loop:  # as README runs it: `checkpoint` is still held while the next record is made
            summary = evaluate(checkpoint)
            samples.append(device_bytes())
            writer(summary)
            samples.append(device_bytes())
    assert samples[0] == before  # the loop's first look at the data, before its state exists
    samples = [sample - before for sample in samples[1:]]
    assert len(samples) > 30
    assert min(samples) >= state_bytes  # the measure sees the loop's own state
    assert max(samples) <= 1.6 * state_bytes, [round(sample / state_bytes, 2) for sample in samples]
    restored = fs.CheckpointFileReader(tmp_path / "run").read(None)
    assert restored.step == 20
    for saved, held in zip(
        jax.tree.leaves(restored.state["target"]), jax.tree.leaves(summary.state.params), strict=True
    ):
        np.testing.assert_array_equal(saved, held)


def test_records_hold_read_only_host_copies_that_stay_valid_as_the_loop_goes_on(tmp_path):
    data = toy.batches(40, 8)
    task = fs.TrainTask(apply=MLP.apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=data)
    loop = fs.TrainLoop(MLP.init, task, rng=0, n_steps=8, n_steps_per_checkpoint=4, stdout=False)
    first = loop.next_checkpoint()
    second = loop.next_checkpoint()
    for leaf in jax.tree.leaves((first.state, first.grads, second.state, loop.state)):
        assert isinstance(leaf, np.ndarray) and not leaf.flags.writeable
    assert int(first.state.step) == 4 and int(second.state.step) == 8
    kernel = first.model_params["Dense_0"]["kernel"]
    assert not np.array_equal(kernel, second.model_params["Dense_0"]["kernel"])
    # A notebook's uses: the model applied to a record's parameters, numpy on them.
    outputs = MLP.apply({"params": first.model_params}, data[0][0])
    assert outputs.shape == (8,) and np.isfinite(np.asarray(outputs)).all()
    assert float(np.abs(kernel).sum()) > 0
    # The older record is saved after the loop went on (and donated the state it was copied from).
    with fs.CheckpointFileWriter(tmp_path / "run") as writer:
        writer(first)
    restored = fs.CheckpointFileReader(tmp_path / "run", step=4).read(None)
    np.testing.assert_array_equal(restored.state["target"]["Dense_0"]["kernel"], kernel)
    # A record's (host) state is a template to restore into, as a device state is.
    into_host_template = fs.CheckpointFileReader(tmp_path / "run", step=4).restore(second.state)
    for got, want in zip(jax.tree.leaves(into_host_template), jax.tree.leaves(first.state), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_record_s_fingerprint_reads_its_host_copies_where_they_are_not_a_copy_of_them():
    # The fingerprint, taken when first read, reads a device array over each large copy's own bytes: a copy of
    # the whole state held a save 256 MiB beyond its budget in test_host_memory_processes.py.
    wide = toy.MLP(width=4096)  # a first kernel of 64 KiB, and adam's two moments of it
    task = fs.TrainTask(apply=wide.apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=toy.batches(4, 8))
    record = fs.TrainLoop(wide.init, task, rng=0, n_steps=2, n_steps_per_checkpoint=2, stdout=False).next_checkpoint()
    large = [leaf for leaf in jax.tree.leaves(record.state) if leaf.nbytes >= copies._ALIGNED_FROM]
    assert len(large) == 3, [leaf.shape for leaf in jax.tree.leaves(record.state)]
    for leaf in large:
        assert copies.on_devices(leaf).unsafe_buffer_pointer() == leaf.ctypes.data, (leaf.shape, leaf.dtype)
    small = min(jax.tree.leaves(record.state), key=lambda leaf: leaf.nbytes)
    assert copies.on_devices(small).shape == small.shape  # copied again: a few KiB


def test_device_records_hold_device_copies_and_a_bad_choice_is_refused_before_any_work():
    loop = fs.TrainLoop(
        MLP.init,
        fs.TrainTask(apply=MLP.apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=toy.batches(8, 8)),
        rng=0,
        n_steps=4,
        n_steps_per_checkpoint=2,
        stdout=False,
        record_memory="device",
    )
    first = loop.next_checkpoint()
    loop.next_checkpoint()  # donates the loop's state: the record's copy is its own
    for leaf in jax.tree.leaves(first.state):
        assert isinstance(leaf, jax.Array) and leaf.sharding.memory_kind == "device" and not leaf.is_deleted()
    drawn = []

    def data():
        drawn.append(1)
        yield from toy.batches(4, 8)

    task = fs.TrainTask(apply=MLP.apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=data())
    with pytest.raises(ValueError, match=r"record_memory must be one of \('host', 'device'\), got 'gpu'"):
        fs.TrainLoop(MLP.init, task, rng=0, n_steps=4, stdout=False, record_memory="gpu")
    assert drawn == []


def test_evaluation_of_the_newest_record_uses_the_loops_arrays_and_an_older_one_its_host_copy():
    task = fs.TrainTask(apply=MLP.apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=toy.batches(40, 8))
    loop = fs.TrainLoop(MLP.init, task, rng=0, n_steps=8, n_steps_per_checkpoint=4, stdout=False)
    evaluate = fs.EvalLoop(fs.EvalTask(apply=MLP.apply, metrics={"loss": toy.mse}, data=toy.batches(1, 8, seed=3)), 1)
    record = loop.next_checkpoint()
    view = record.device_state()
    assert view is not None and all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(view))
    newest = evaluate(record).metrics["eval"]["loss"]
    assert record.with_metrics({}).device_state() is view  # a summary shares the state
    loop.next_checkpoint()
    assert record.device_state() is None
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(view.params))  # donated: why the view ended
    assert evaluate(record).metrics["eval"]["loss"] == newest


def test_a_resumed_loop_reads_into_an_abstract_template_not_a_fresh_state(tmp_path):
    task = fs.TrainTask(apply=MLP.apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=toy.batches(40, 8))
    first = fs.TrainLoop(MLP.init, task, rng=0, n_steps=4, n_steps_per_checkpoint=4, stdout=False)
    with fs.CheckpointFileWriter(tmp_path / "run") as writer:
        saved = [writer(record) for record in first][-1]
    templates = []

    class Reader(fs.CheckpointFileReader):
        def read(self, template):
            templates.append(template)
            return super().read(template)

    loop = fs.TrainLoop(Reader(tmp_path / "run", target=MLP.init), task, rng=0, n_steps=8, stdout=False)
    [template] = templates
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(template.state))
    assert loop.step == 4
    for got, want in zip(jax.tree.leaves(loop.state), jax.tree.leaves(saved.state), strict=True):
        np.testing.assert_array_equal(got, want)
