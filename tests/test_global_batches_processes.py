"""global_batches: the global batch at step s is fixed whatever the process count, and a resume does not draw.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of global_batches are in test_global_batches.py and test_global_batches_joined.py.
"""

import itertools

import numpy as np
from test_global_batches import X, Y

import flaxstate as fs


def doubled(example):
    x, y = example
    return x * 2, y


class Pairs:
    """A random-access source of `(x, y)` examples (picklable: grain's workers take a copy)."""

    def __len__(self):
        return len(X)

    def __getitem__(self, index):
        return X[index], Y[index]


def test_a_transform_in_grain_workers_and_threads_keeps_the_exact_position(tmp_path):
    plain = fs.global_batches(Pairs(), batch_size=4, seed=7, transform=doubled)
    want = list(itertools.islice(plain.iter_from(9), 3))
    for options in ({"read_threads": 4}, {"workers": 2}):
        data = fs.global_batches(Pairs(), batch_size=4, seed=7, transform=doubled, **options)
        got = list(itertools.islice(data.iter_from(9), 3))  # a resume at step 9
        for (got_x, got_y), (want_x, want_y) in zip(got, want, strict=True):
            np.testing.assert_array_equal(got_x, want_x)
            np.testing.assert_array_equal(got_y, want_y)
