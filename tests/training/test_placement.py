"""Where a loop runs: a partitioning becomes the data-parallel or the sharded placement, with one interface."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec

from flaxstate.sharding import Partitioning
from flaxstate.train_state import FlaxOptimTrainState
from flaxstate.training import placement

X = np.ones((8, 4), np.float32)


class Named(nn.Module):
    @nn.compact
    def __call__(self, x):
        kernel = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        return nn.Dense(6, kernel_init=kernel, use_bias=False)(x)


def one_device_mesh():
    return Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))


def test_a_data_parallel_placement_replicates_the_state_and_splits_the_batch_over_its_devices():
    where = placement.create(Partitioning(devices=jax.devices()[:1]))
    assert isinstance(where, placement.DataParallel)
    assert where.n_local_devices == where.n_local_parts == 1 and where.process_part() == (0, 1)
    assert where.global_batch_size(8) == 8 * jax.process_count()
    assert where.state_shardings({"w": jnp.ones(3)}).spec == PartitionSpec()
    where.check_batch(((X,), (X,)), "TrainTask", n_microbatches=8)
    with pytest.raises(ValueError, match="n_microbatches=3"):
        where.check_batch(((X,), (X,)), "TrainTask", n_microbatches=3)


def test_a_sharded_placement_shards_each_leaf_by_its_logical_axes_and_compiles_the_global_function():
    rules = [("batch", "data"), ("embed", "data"), ("mlp", "model")]
    where = placement.create(Partitioning(mesh=one_device_mesh(), axis_rules=rules))
    assert isinstance(where, placement.Sharded)
    variables = Named().init(jax.random.key(0), X)
    state = FlaxOptimTrainState.create(optax.adam(1e-3), variables)
    shardings = where.state_shardings(jax.eval_shape(lambda: state))
    assert shardings.params["Dense_0"]["kernel"].spec == PartitionSpec("data", "model")
    assert where.across.index() == 0 and where.across.mean({"a": 1}) == {"a": 1}  # GSPMD averages, not the step
    assert where.process_part() == (0, 1) and where.global_batch_size(8) == 8
    compiled = where.compile_eval(lambda s, batch, rng: {"sum": batch[0][0].sum()}, shardings)
    assert float(compiled(state, ((X,), ()), jax.random.key_data(jax.random.key(0)))["sum"]) == X.sum()
