import jax
import numpy as np
import pytest
from conftest import run_example
from flaxstate_testing import examples

import flaxstate as fs

digits = examples.load("digits")


def test_example_trains_checkpoints_and_resumes(digits_run):
    output_dir, first, second = digits_run
    assert "Total number of trainable weights: 9,866" in first
    assert "step 20: eval/acc" in first and "Resumed" not in first
    assert "Resumed from the checkpoint at step 20." in second
    assert "step 40: eval/acc" in second and "step 20:" not in second
    assert sorted(p.name for p in output_dir.iterdir() if p.name.isdigit()) == ["20", "40"]
    assert (output_dir / "lowest-eval-loss").is_dir()
    assert list(output_dir.glob("events.out.tfevents.*"))


def test_the_resumed_example_ends_bit_for_bit_as_an_uninterrupted_run(digits_run, tmp_path):
    resumed_dir, _, _ = digits_run
    run_example(tmp_path / "straight", 40)
    resumed, straight = (fs.CheckpointFileReader(path).read(None) for path in (resumed_dir, tmp_path / "straight"))
    assert resumed.step == straight.step == 40
    assert resumed.data_position == straight.data_position
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(straight.state), strict=True):
        np.testing.assert_array_equal(a, b)


def draw(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_the_example_data_restores_from_grain_state_exactly():
    x = np.arange(100, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    data = digits.shuffled_batches(x, np.arange(100), batch_size=8, seed=0).to_iter_dataset(digits.READ_OPTIONS)
    iterator = iter(data)
    draw(iterator, 30)  # past two epochs of 12 batches
    state = iterator.get_state()
    expected = draw(iterator, 20)
    restored = iter(data)
    restored.set_state(state)
    for (x_a, y_a), (x_b, y_b) in zip(expected, draw(restored, 20), strict=True):
        np.testing.assert_array_equal(x_a, x_b)
        np.testing.assert_array_equal(y_a, y_b)
        np.testing.assert_array_equal(x_a[:, 0], y_a)  # rows stay paired


def test_the_example_data_is_a_new_permutation_every_epoch():
    n, batch_size = 100, 8  # 12 batches an epoch, 4 examples left over
    iterator = iter(digits.shuffled_batches(np.zeros((n, 1), np.float32), np.arange(n), batch_size, seed=0))
    epochs = [np.concatenate([y for _, y in draw(iterator, 12)]) for _ in range(3)]
    for epoch in epochs:
        assert len(np.unique(epoch)) == len(epoch) == 96  # no example twice within an epoch
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    assert len(np.setdiff1d(np.arange(n), np.concatenate(epochs))) < 4  # the left-over examples change


@pytest.mark.parametrize("batch_size", [64, 32])
def test_the_example_splits_fill_whole_batches(batch_size):
    train, evaluation = digits.digits(batch_size)
    x, y = next(iter(train))
    assert x.shape == (batch_size, 64) and x.dtype == np.float32 and y.shape == (batch_size,)
    assert len(evaluation) == 297 // batch_size
    assert all(x.shape == (batch_size, 64) for x, _ in evaluation)
