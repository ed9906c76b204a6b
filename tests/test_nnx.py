import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flaxstate_testing import toy

import flaxstate as fs


class NNXMLP(nnx.Module):
    """toy.MLP written in NNX."""

    def __init__(self, rngs: nnx.Rngs, width: int = 16):
        self.Dense_0 = nnx.Linear(4, width, rngs=rngs)
        self.Dense_1 = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x):
        return self.Dense_1(nnx.tanh(self.Dense_0(x)))[:, 0]


class NNXBatchNormNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(self.dropout(self.norm(self.dense(x))))[:, 0]


def losses(init, apply, n_steps=30):
    task = fs.TrainTask(apply=apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=toy.batches(n_steps, 8))
    loop = fs.TrainLoop(init, task, jax.random.key(0), n_steps=n_steps, n_steps_per_checkpoint=1, stdout=False)
    return np.array([record.loss for record in loop]), loop


def test_nnx_and_linen_versions_of_a_network_train_alike():
    linen = toy.MLP()
    linen_losses, linen_loop = losses(linen.init, linen.apply)

    model = NNXMLP(nnx.Rngs(0))
    # Start from the linen run's initial parameters, so both runs do the same arithmetic.
    initial = linen.init({"params": jax.random.fold_in(jax.random.fold_in(jax.random.key(0), 0), 0)}, jnp.ones((8, 4)))[
        "params"
    ]
    for name in ("Dense_0", "Dense_1"):
        getattr(model, name).kernel.value = initial[name]["kernel"]
        getattr(model, name).bias.value = initial[name]["bias"]
    init, apply = fs.nnx_functions(model)
    nnx_losses, nnx_loop = losses(init, apply)
    np.testing.assert_allclose(nnx_losses, linen_losses, rtol=1e-5, atol=1e-6)
    assert nnx_losses[-1] < nnx_losses[0] / 2
    np.testing.assert_allclose(
        nnx_loop.state.params["Dense_0"]["kernel"], linen_loop.state.params["Dense_0"]["kernel"], rtol=1e-4, atol=1e-6
    )


def test_nnx_batch_statistics_and_dropout_are_handled():
    init, apply = fs.nnx_functions(NNXBatchNormNet(nnx.Rngs(0)))
    variables = init(None, None)
    assert set(variables) == {"params", "batch_stats"}
    train_losses, loop = losses(init, apply, n_steps=20)
    state = loop.state
    assert float(jnp.abs(state.flax_mutables["batch_stats"]["norm"]["mean"]).sum()) > 0
    assert train_losses[-1] < train_losses[0]
    x, y = toy.batches(1, 8, seed=4)[0]
    trained = {"params": state.params, **state.flax_mutables}
    # Evaluation is deterministic (no dropout, running statistics); training draws masks from rngs.
    np.testing.assert_array_equal(apply(trained, x), apply(trained, x))
    a, _ = apply(trained, x, rngs={"dropout": jax.random.key(1)}, mutable=["batch_stats"])
    b, _ = apply(trained, x, rngs={"dropout": jax.random.key(2)}, mutable=["batch_stats"])
    assert not np.array_equal(a, b)
    evaluate = fs.EvalLoop(fs.EvalTask(apply=apply, metrics={"loss": toy.mse}, data=[(x, y)]), rng=jax.random.key(1))
    record = fs.Checkpoint(state=state, grads=None, loss=0.0, n_completed_steps=0, elapsed_time=0.0, step=20)
    expected = float(toy.mse(apply(trained, x), y))
    np.testing.assert_allclose(evaluate(record).metrics["eval"]["loss"], expected, rtol=1e-6)
