"""EvalLoop's construction: options by keyword after `rng`, and `rng` a key or an int seed, as TrainLoop takes them."""

import jax
import numpy as np
import pytest
from flaxstate_testing import toy
from flaxstate_testing.loops import make_loop

import flaxstate as fs


def task():
    return fs.EvalTask(apply=toy.MLP().apply, metrics={"mse": toy.mse}, data=toy.batches(2, 8, seed=5))


def test_options_after_rng_are_keyword_only():
    with pytest.raises(TypeError, match="positional"):
        fs.EvalLoop(task(), jax.random.key(1), 2)
    with pytest.raises(TypeError, match="positional"):
        fs.EvalLoop(task(), 1, 2, None, "eval")
    assert fs.EvalLoop(task(), 1, n_steps=2, group="held_out") is not None


def test_an_int_rng_is_a_seed_and_anything_else_is_refused_naming_eval_loop():
    record = make_loop(n_steps=2, every=2).next_checkpoint()
    collections = {"rng_collections": ("dropout",)}
    by_seed = fs.EvalLoop(task(), 3, n_steps=2, **collections)(record).metrics["eval"]["mse"]
    by_numpy_seed = fs.EvalLoop(task(), np.int64(3), n_steps=2, **collections)(record).metrics["eval"]["mse"]
    by_key = fs.EvalLoop(task(), jax.random.key(3), n_steps=2, **collections)(record).metrics["eval"]["mse"]
    assert by_seed == by_numpy_seed == by_key
    with pytest.raises(TypeError, match=r"EvalLoop rng must be a random key \(jax.random.key\(0\)\) or an int seed"):
        fs.EvalLoop(task(), "1")
    with pytest.raises(TypeError, match="EvalLoop rng must be"):
        fs.EvalLoop(task(), 1.5)


@pytest.mark.parametrize("n_steps", [0, -1, 1.5, True])
def test_n_steps_must_be_a_positive_int(n_steps):
    with pytest.raises(ValueError, match=f"EvalLoop n_steps must be a positive int, got {n_steps!r}"):
        fs.EvalLoop(task(), 0, n_steps=n_steps)
