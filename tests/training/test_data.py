"""The data's position across a resume that changes the batch size: no example skipped or repeated."""

import grain
import jax
import numpy as np
import optax
import pytest
from flaxstate_testing import toy

import flaxstate as fs

MODEL = toy.MLP()
N_EXAMPLES = 4096
X = np.random.RandomState(0).randn(N_EXAMPLES, 4).astype(np.float32)
Y = (X @ np.arange(1, 5, dtype=np.float32)).astype(np.float32)


class Examples:
    """A re-iterable of batches in example order that records the first example of each batch it yields."""

    def __init__(self, batch_size):
        self.batch_size = batch_size
        self.passes = []

    def __iter__(self):
        starts = []
        self.passes.append(starts)
        for start in range(0, N_EXAMPLES - self.batch_size + 1, self.batch_size):
            starts.append(start)
            yield X[start : start + self.batch_size], Y[start : start + self.batch_size]


def run(directory, data, n_steps, stdout=False):
    task = fs.TrainTask(apply=MODEL.apply, optimizer=optax.sgd(0.01), loss=toy.mse, data=data)
    reader = fs.CheckpointFileReader(directory, target=MODEL.init)
    loop = fs.TrainLoop(reader, task, jax.random.key(0), n_steps=n_steps, n_steps_per_checkpoint=n_steps, stdout=stdout)
    with fs.CheckpointFileWriter(directory, keep=2) as writer:
        for record in loop:
            writer(record)
    return loop


@pytest.mark.parametrize(("before", "after"), [(16, 32), (32, 16)])
def test_a_changed_batch_size_resumes_at_the_same_example(tmp_path, capsys, before, after):
    run(tmp_path, Examples(before), n_steps=10)
    data = Examples(after)
    run(tmp_path, data, n_steps=13, stdout=True)
    trained = data.passes[-1]
    consumed = 10 * before
    # Re-created and advanced by examples: the first batch trained after the resume starts at example 10 * before.
    first_trained = consumed // after
    assert trained[first_trained] == consumed
    assert trained[: first_trained + 3] == list(range(0, consumed + 3 * after, after))
    out = capsys.readouterr().out
    assert f"batch size changed from {before} to {after}" in out and f"moved to example {consumed}" in out


def test_a_grain_dataset_resumed_with_another_batch_size_continues_at_the_same_example(tmp_path):
    def dataset(batch_size):
        examples = grain.MapDataset.source(list(zip(X[:256], Y[:256], strict=True))).shuffle(seed=3).repeat()
        return examples.batch(batch_size)

    run(tmp_path, dataset(8), n_steps=6)  # examples 0-47 of the shuffled stream
    run(tmp_path, dataset(16), n_steps=8)  # moved to example 48: trains batches 3 and 4 of 16
    # Batch 3 of 16 holds examples 48-63: batches 6 and 7 of 8, laid end to end.
    np.testing.assert_array_equal(dataset(16)[3][0], np.concatenate([dataset(8)[6][0], dataset(8)[7][0]]))
    # Where the stream stands, as saved: its next batch is batch 5 of 16.
    assert fs.CheckpointFileReader(tmp_path).read(None).data_position["iterator_states"] == [{"next_index": 5}]


def test_a_resume_after_a_resume_that_changed_the_batch_size_continues_at_the_right_example(tmp_path):
    run(tmp_path, Examples(16), n_steps=10)  # examples 0-159
    run(tmp_path, Examples(32), n_steps=13)  # moved to example 160 (batch 5 of 32), trains 3 batches: up to 255
    data = Examples(32)
    run(tmp_path, data, n_steps=14)
    # The position counts the batches this stream served (8 of 32), not the loop's steps (13): the one
    # step trained (the last batch drawn, after the 8 moved past) starts at example 256.
    assert data.passes[-1] == list(range(0, 257, 32))


def test_examples_that_do_not_divide_into_the_new_batch_size_are_refused(tmp_path):
    run(tmp_path, Examples(16), n_steps=3)  # 48 examples
    with pytest.raises(ValueError, match="batch size of 16 and this run's is 32: its 48 examples .* Resume with"):
        run(tmp_path, Examples(32), n_steps=5)


def test_a_one_shot_iterator_cannot_be_moved_and_says_so(tmp_path):
    run(tmp_path, Examples(16), n_steps=4)
    with pytest.raises(ValueError, match="batch size of 16 and this run's is 32; .* one-shot iterator"):
        run(tmp_path, iter(Examples(32)), n_steps=6)


def test_the_same_batch_size_resumes_from_the_iterator_state(tmp_path):
    data = Examples(16)
    run(tmp_path, data, n_steps=4)
    again = Examples(16)
    run(tmp_path, again, n_steps=6)
    assert again.passes[-1][:6] == [0, 16, 32, 48, 64, 80]
