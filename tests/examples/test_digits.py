import numpy as np
import pytest
from flaxstate_testing import examples

digits = examples.load("digits")


@pytest.mark.parametrize("batch_size", [64, 32])
def test_the_example_splits_fill_whole_batches(batch_size):
    train, evaluation = digits.digits(batch_size)
    x, y = next(iter(train))
    assert x.shape == (batch_size, 64) and x.dtype == np.float32 and y.shape == (batch_size,)
    assert len(evaluation) == 297 // batch_size
    assert all(x.shape == (batch_size, 64) for x, _ in evaluation)
