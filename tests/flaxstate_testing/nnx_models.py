"""NNX models as Flax's NNX tutorials write them, small enough to compile in a second, for the tests and workers."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


class Calls(nnx.Variable):
    """A Variable of the user's own: how many times the module was called (counted in `__call__`)."""


class CNN(nnx.Module):
    """Flax's NNX MNIST tutorial's CNN (`docs_nnx/mnist_tutorial.md`), narrower, on 8 x 8 images: rngs at call
    time, BatchNorm, Dropout, and a Variable of the user's own."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(4, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.25)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(4 * 4 * 4, 16, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.25)
        self.linear2 = nnx.Linear(16, 10, rngs=rngs)
        self.calls = Calls(jnp.zeros((), jnp.int32))

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        self.calls[...] += 1
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def loss_fn(model: CNN, batch: dict, rngs: nnx.Rngs | None = None) -> tuple[jax.Array, jax.Array]:
    """The tutorial's loss: cross-entropy of the logits, and the logits as its aux."""
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"]).mean()
    return loss, logits


def accuracy(model: CNN, batch: dict) -> jax.Array:
    return (model(batch["image"]).argmax(axis=1) == batch["label"]).mean()


def digits(n_batches: int, batch_size: int = 16, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """scikit-learn's digits (8 x 8, shipped with it), as the tutorial's dict batches."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(labels))
    images = (images[order] / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    labels = labels[order].astype(np.int32)
    return [
        {"image": images[i * batch_size : (i + 1) * batch_size], "label": labels[i * batch_size : (i + 1) * batch_size]}
        for i in range(n_batches)
    ]


class MLP(nnx.Module):
    """`toy.MLP` in NNX (its layers named as linen names them), with a dropout of its own streams and a count of its
    calls (a Variable of the user's own) optional."""

    def __init__(self, rngs: nnx.Rngs, width: int = 16, dropout: float | None = None, calls: bool = False):
        self.Dense_0 = nnx.Linear(4, width, rngs=rngs)
        self.Dense_1 = nnx.Linear(width, 1, rngs=rngs)
        self.dropout = None if dropout is None else nnx.Dropout(dropout, rngs=rngs)
        self.calls = Calls(jnp.zeros((), jnp.int32)) if calls else None

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.calls is not None:
            self.calls[...] += 1
        hidden = nnx.tanh(self.Dense_0(x))
        if self.dropout is not None:
            hidden = self.dropout(hidden)
        return self.Dense_1(hidden)[:, 0]


class DropoutProbe(nnx.Module):
    """`toy.DropoutProbe` in NNX, drawing from its own stream (`nnx.Dropout(..., rngs=rngs)`): its gradient is the
    dropout mask (scaled), which shows which mask a device drew."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.ones((64,)))
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.sum(self.dropout(jnp.ones((64,))) * self.w[...]) + 0 * x[:, 0]
