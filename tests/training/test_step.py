"""The step functions, on one device without a loop: interleaved microbatches, the gradients, one update, one eval."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flaxstate_testing.programs import MODEL, MUTABLE, X, Y, state
from flaxstate_testing.toy import mse

from flaxstate.sharding import Partitioning
from flaxstate.training import step
from flaxstate.training.placement import create

ACROSS = create(Partitioning(devices=jax.devices()[:1])).across


def test_microbatches_interleave_the_examples():
    split = step.microbatches(jnp.arange(6), 3)
    assert split.tolist() == [[0, 3], [1, 4], [2, 5]]


def test_microbatched_gradients_are_the_mean_of_the_microbatches_and_equal_the_whole_batch_s():
    gradients = step.loss_gradients(MODEL.apply, mse, mutable=MUTABLE)
    whole_loss_and_grads = gradients(state(), {}, (X,), (Y,), {})
    (loss, _), grads = step.microbatched(gradients, 4)(state(), {}, (X,), (Y,), {})
    (whole_loss, _), whole = whole_loss_and_grads
    np.testing.assert_allclose(loss, whole_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(whole), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert step.microbatched(gradients, 1) is gradients


def test_one_train_step_is_one_sgd_update_of_the_batch_s_gradients():
    train_step = step.make_train_step(MODEL.apply, mse, rng_names=(), mutable=MUTABLE, across=ACROSS)
    before = state()
    after, grads, loss = jax.jit(train_step)(before, ((X,), (Y,)), jax.random.key(1))
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, before.params, grads)
    for a, b in zip(jax.tree.leaves(after.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert int(after.step) == 1
    np.testing.assert_allclose(loss, mse(MODEL.apply({"params": before.params}, X), Y), rtol=1e-6)


def test_a_loss_that_is_not_a_scalar_is_named_and_device_rngs_differ_per_step_and_name():
    train_step = step.make_train_step(
        MODEL.apply, lambda o, y: (o - y) ** 2, rng_names=(), mutable=MUTABLE, across=ACROSS
    )
    with pytest.raises(
        ValueError, match=r"TrainTask.loss returned an array of shape \(8, 2\); it must return a scalar"
    ):
        train_step(state(), ((X,), (Y,)), jax.random.key(1))
    rngs = [step.device_rngs(jax.random.key(0), jnp.asarray(s), ("dropout", "noise"), ACROSS) for s in (0, 1)]
    data = [jax.random.key_data(key).tolist() for r in rngs for key in r.values()]
    assert len({tuple(d) for d in data}) == 4


def test_the_eval_step_gives_each_metric_of_the_batch():
    eval_step = step.make_eval_step(MODEL.apply, {"mse": mse}, (), ACROSS, jax.random.key_impl(jax.random.key(0)))
    values = eval_step(state(), ((X,), (Y,)), jax.random.key_data(jax.random.key(0)))
    np.testing.assert_allclose(values["mse"], mse(MODEL.apply({"params": state().params}, X), Y), rtol=1e-6)
