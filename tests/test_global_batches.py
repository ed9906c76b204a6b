"""global_batches: the global batch at step s is fixed whatever the process count, and a resume does not draw."""

import collections
import dataclasses
import itertools

import numpy as np
import pytest
from flaxstate_testing import toy
from flaxstate_testing.loops import make_loop

import flaxstate as fs
from flaxstate.training.data import DataStream

X = np.arange(30, dtype=np.float32).reshape(15, 2)
Y = np.arange(15, dtype=np.int32)


def test_every_example_once_an_epoch_in_a_new_order_each_epoch_and_batches_span_epochs():
    data = fs.global_batches((X, Y), batch_size=4, seed=1)
    labels = np.concatenate([y for _, y in itertools.islice(data, 15)])  # 60 examples: 4 epochs of 15
    epochs = labels.reshape(4, 15)
    for epoch in epochs:
        assert sorted(epoch) == list(range(15))  # each example once an epoch, none dropped
    assert len({tuple(epoch) for epoch in epochs}) == 4  # a new order each epoch
    assert [len(y) for _, y in itertools.islice(data, 4)] == [4, 4, 4, 4]  # batch 3 spans epochs 0 and 1
    again = np.concatenate([y for _, y in itertools.islice(fs.global_batches((X, Y), batch_size=4, seed=1), 15)])
    np.testing.assert_array_equal(again, labels)  # the same seed, the same order
    other = np.concatenate([y for _, y in itertools.islice(fs.global_batches((X, Y), batch_size=4, seed=2), 4)])
    assert not np.array_equal(other, labels[:16])
    ordered = np.concatenate([y for _, y in itertools.islice(fs.global_batches((X, Y), 4, shuffle=False), 4)])
    np.testing.assert_array_equal(ordered, np.arange(16) % 15)
    x0, y0 = next(iter(data))
    np.testing.assert_array_equal(x0, X[y0])  # one gather keeps arrays together


def test_the_parts_of_p_processes_make_the_global_batch_and_iter_from_skips_without_reading():
    data = fs.global_batches({"x": X, "y": Y}, batch_size=6, seed=5)
    for step in (0, 7, 123):
        whole = data.indices(step)
        parts = np.concatenate([data.indices(step, (index, 3)) for index in range(3)])
        np.testing.assert_array_equal(parts, whole)
    from_seven = next(data.iter_from(7))
    np.testing.assert_array_equal(from_seven["y"], Y[data.indices(7)])


class Counting:
    """A random-access source of `(x, {"label": y})` examples (`(x, y)`: `pairs`) that counts its reads."""

    def __init__(self, pairs=False):
        self.reads = collections.Counter()
        self.pairs = pairs

    def __len__(self):
        return len(X)

    def __getitem__(self, index):
        self.reads[index] += 1
        return (X[index], np.float32(Y[index])) if self.pairs else (X[index], {"label": Y[index]})


def test_a_random_access_source_is_read_example_by_example_and_stacked_in_its_structure():
    source = Counting()
    data = fs.global_batches(source, batch_size=5, seed=0, transform=lambda e: (e[0] * 2, e[1]))
    x, target = next(iter(data))
    assert x.shape == (5, 2) and target["label"].shape == (5,)
    np.testing.assert_array_equal(x, X[target["label"]] * 2)
    assert sum(source.reads.values()) == 5


@pytest.mark.parametrize("step", [10, 100_000])
def test_a_stream_resumed_far_in_reads_what_one_resumed_near_does(step):
    source = Counting()
    stream = DataStream(fs.global_batches(source, batch_size=5, seed=0), "TrainTask")
    stream.restore({"n_batches": step, "batch_size": 5}, step, 5)
    x, target = stream.next()
    assert sum(source.reads.values()) == 5  # the batch it hands out, none before it
    np.testing.assert_array_equal(target["label"], Y[fs.global_batches(Counting(), 5, seed=0).indices(step)])


def test_a_loop_resumed_at_step_100000_reads_no_more_than_one_at_step_10(tmp_path):
    reads = {}
    for step in (10, 100_000):
        run_dir = tmp_path / str(step)
        loop = make_loop(data=fs.global_batches(Counting(pairs=True), batch_size=5), n_steps=2, every=2)
        record = next(iter(loop))
        state = record.state.replace(step=np.asarray(step, np.int32))
        record = dataclasses.replace(record, state=state, step=step, data_position={"n_batches": step, "batch_size": 5})
        with fs.CheckpointFileWriter(run_dir) as writer:
            writer(record)
        source = Counting(pairs=True)
        resumed = make_loop(
            data=fs.global_batches(source, batch_size=5),
            init=fs.CheckpointFileReader(run_dir, target=toy.MLP().init),
            n_steps=step + 2,
            every=2,
        )
        assert resumed.step == step
        next(iter(resumed))
        reads[step] = sum(source.reads.values())
    assert reads[100_000] == reads[10] <= 5 * 3  # the first batch looked at, then two steps


def test_bad_settings_are_refused_naming_the_problem():
    with pytest.raises(ValueError, match="differ in length"):
        fs.global_batches((X, Y[:3]), 4)
    with pytest.raises(ValueError, match="empty"):
        fs.global_batches(np.zeros((0, 2)), 4)
    with pytest.raises(ValueError, match="positive int"):
        fs.global_batches((X, Y), 0)
    with pytest.raises(ValueError, match="random-access"):
        fs.global_batches(iter([1, 2]), 4)
    with pytest.raises(ValueError, match="has 15 examples, fewer than one global batch of 16"):
        fs.global_batches((X, Y), 16)  # a batch would repeat examples
    with pytest.raises(ValueError, match="has 3 examples, fewer than one global batch of 4"):
        fs.global_batches([(x, y) for x, y in zip(X[:3], Y[:3], strict=True)], 4)
    assert len(next(iter(fs.global_batches((X, Y), 15)))[1]) == 15  # exactly one batch: every example once
    with pytest.raises(ValueError, match="seed must be an int of at least 0"):
        fs.global_batches((X, Y), 4, seed=-1)  # numpy's SeedSequence would refuse it only at the first batch
    assert fs.global_batches((X, Y), 4, seed=np.int64(3)).seed == 3


def test_jax_arrays_are_a_source_as_numpy_arrays_are():
    import jax.numpy as jnp

    on_host = fs.global_batches({"x": X, "y": Y}, batch_size=4, seed=3)
    on_device = fs.global_batches({"x": jnp.asarray(X), "y": jnp.asarray(Y)}, batch_size=4, seed=3)
    assert on_device.n_examples == 15  # its examples, not the tuple's or dict's length
    for want, got in itertools.islice(zip(on_host, on_device, strict=False), 5):
        for key in ("x", "y"):
            assert isinstance(got[key], np.ndarray)
            np.testing.assert_array_equal(got[key], want[key])
    x, y = next(iter(fs.global_batches((jnp.asarray(X), jnp.asarray(Y)), batch_size=15, shuffle=False)))
    np.testing.assert_array_equal(y, Y)
