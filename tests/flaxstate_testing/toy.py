"""Small models and deterministic data shared by the tests and their workers."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P


class MLP(nn.Module):
    width: int = 16

    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(self.width)(x))
        return nn.Dense(1)(x)[:, 0]


class ShardedMLP(nn.Module):
    """`MLP` with its hidden units named by the logical axis `hidden` (`SHARDED_RULES` shards them over `fsdp`)."""

    width: int = 16

    @nn.compact
    def __call__(self, x):
        kernel = nn.with_logical_partitioning(nn.initializers.lecun_normal(), (None, "hidden"))
        bias = nn.with_logical_partitioning(nn.initializers.zeros, ("hidden",))
        x = nn.tanh(nn.Dense(self.width, kernel_init=kernel, bias_init=bias)(x))
        out = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("hidden", None))
        out_bias = nn.with_logical_partitioning(nn.initializers.zeros, (None,))
        return nn.Dense(1, kernel_init=out, bias_init=out_bias)(x)[:, 0]


class ExplicitShardedMLP(nn.Module):
    """`ShardedMLP` written as JAX's explicit sharding asks, for a mesh whose axes are Explicit (`jax.make_mesh`):
    where the batch's `fsdp` axis meets the kernels', each product names its output's sharding (`out_sharding=`),
    and the bias, sharded as the hidden units are, is `reshard`ed to the product's."""

    width: int = 16

    @nn.compact
    def __call__(self, x):
        hidden = P("fsdp", None)  # the batch's rows as the data came, every hidden unit
        kernel = self.param("kernel", nn.with_logical_partitioning(nn.initializers.lecun_normal(), (None, "hidden")),
                            (x.shape[-1], self.width))  # fmt: skip
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("hidden",)), (self.width,))
        x = jnp.tanh(jnp.einsum("bi,ih->bh", x, kernel, out_sharding=hidden) + jax.sharding.reshard(bias, P(None)))
        out = self.param("out", nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("hidden", None)),
                         (self.width, 1))  # fmt: skip
        return jnp.einsum("bh,ho->bo", x, out, out_sharding=hidden)[:, 0]


SHARDED_RULES = (("batch", "fsdp"), ("hidden", "fsdp"))
"""`ShardedMLP`'s axes on a mesh with one axis, `fsdp`: each device holds its share of the hidden units."""


class BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        train = self.is_mutable_collection("batch_stats")
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.Dropout(0.3, deterministic=not self.has_rng("dropout"))(x)
        return nn.Dense(1)(x)[:, 0]


class DropoutProbe(nn.Module):
    """Its gradient is the dropout mask (scaled): it shows which mask a device drew."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.ones, (64,))
        mask = nn.Dropout(0.5, deterministic=not self.has_rng("dropout"))(jnp.ones((64,)))
        return jnp.sum(mask * w) + 0 * x[:, 0]


MODELS = {"mlp": MLP, "batchnorm": BatchNormNet, "dropout": DropoutProbe}


def mse(outputs, targets):
    return jnp.mean((outputs - targets) ** 2)


def batches(n_batches: int, batch_size: int, features: int = 4, seed: int = 0):
    """Deterministic regression batches `(x, y)` as numpy arrays."""
    rng = np.random.RandomState(seed)
    w = rng.randn(features).astype(np.float32)
    result = []
    for _ in range(n_batches):
        x = rng.randn(batch_size, features).astype(np.float32)
        result.append((x, (x @ w + 0.1 * rng.randn(batch_size)).astype(np.float32)))
    return result


def shard(batch_list, process_id: int, n_processes: int):
    """This process's rows of every global batch."""

    def rows(array):
        size = array.shape[0] // n_processes
        return array[process_id * size : (process_id + 1) * size]

    return [tuple(rows(a) for a in batch) for batch in batch_list]
