"""What a loop decides before its first step: its key, its rng collections, and its wall-clock start."""

import time

import jax
import numpy as np
import pytest

from flaxstate.training import startup


def test_a_key_comes_from_a_key_raw_key_data_or_an_int_seed_and_nothing_else():
    key = jax.random.key(3)
    assert startup.as_key(key) is key
    for given in (3, np.int64(3), jax.random.key_data(key)):
        np.testing.assert_array_equal(jax.random.key_data(startup.as_key(given)), jax.random.key_data(key))
    with pytest.raises(TypeError, match="EvalLoop rng must be a random key .* got str"):
        startup.as_key("3", "EvalLoop")
    with pytest.raises(TypeError, match="got bool"):
        startup.as_key(True)


def test_the_process_started_before_now():
    started = startup.process_start_time()
    assert started <= time.time() and time.time() - started < 24 * 3600
