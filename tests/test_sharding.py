"""Shardings from logical axes: the rules' checks, the warnings, and a sharded loop on one device."""

import dataclasses
import re
import warnings

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flaxstate_testing import toy
from flaxstate_testing.lm import lm, train_loop
from jax.sharding import Mesh, PartitionSpec

import flaxstate as fs
from flaxstate import sharding

SMALL = lm.Config(
    batch_size=8,
    seq_len=8,
    embed=16,
    heads=2,
    head_dim=8,
    mlp=32,
    layers=1,
    steps_per_checkpoint=2,
    steps_per_dispatch=2,
)


def one_device_mesh():
    return Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), lm.MESH_AXES)


class Named(nn.Module):
    """A dense layer whose kernel's second axis has a name that no rule of the example names."""

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "test_unruled_axis"))
        return nn.Dense(3, kernel_init=init, use_bias=False)(x)


def state_of(model, x):
    return jax.eval_shape(lambda: fs.FlaxOptimTrainState.create(optax.adam(1e-3), model.init(jax.random.key(0), x)))


def test_a_logical_axis_without_a_rule_is_replicated_with_one_warning():
    state = state_of(Named(), np.ones((2, 4), np.float32))
    with pytest.warns(UserWarning, match=r"no axis rule names the logical axis 'test_unruled_axis'.*replicated"):
        shardings = sharding.logical_shardings(state, one_device_mesh(), lm.RULES)
    assert shardings.params["Dense_0"]["kernel"].spec == PartitionSpec("fsdp", None)
    assert shardings.param_states[0].mu["Dense_0"]["kernel"].spec == PartitionSpec("fsdp", None)  # as its parameter
    assert shardings.step.spec == PartitionSpec()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        sharding.logical_shardings(state, one_device_mesh(), lm.RULES)


def test_a_model_without_logical_axes_is_replicated_with_a_warning():
    state = state_of(toy.MLP(width=13), np.ones((2, 4), np.float32))  # a model of its own: warned once each
    with pytest.warns(UserWarning, match="names no logical axes"):
        shardings = sharding.logical_shardings(state, one_device_mesh(), lm.RULES)
    assert all(s.spec == PartitionSpec() for s in jax.tree.leaves(shardings))


def test_rules_that_are_not_pairs_or_name_a_missing_mesh_axis_are_errors():
    with pytest.raises(ValueError, match=r"mesh axis 'tensor', which the mesh does not have: its axes are \('data'"):
        sharding.check_rules(one_device_mesh(), [("embed", "fsdp"), ("mlp", ("model", "tensor"))])
    with pytest.raises(ValueError, match="each rule is a \\(logical name, mesh axis\\) pair"):
        sharding.check_rules(one_device_mesh(), [("embed",)])


def test_the_batch_layout_of_one_process():
    layout = sharding.BatchLayout.create(one_device_mesh(), lm.RULES)
    assert layout.axes == ("data", "fsdp")
    assert layout.spec(stacked=True) == PartitionSpec(None, ("data", "fsdp"))
    assert layout.process_part() == (0, 1)


def test_the_logical_axes_of_a_checkpoint_by_path():
    state = state_of(lm.Transformer(SMALL), np.zeros((1, 8), np.int32))
    axes = sharding.logical_axes_by_path(state)
    assert axes["target/Block_0/Dense_0/kernel"] == ["embed", "mlp"]
    assert axes["state/param_states/0/mu/Embed_0/embedding"] == ["vocab", "embed"]
    assert axes["target/position"] == [None, "embed"]
    assert "state/step" not in axes
    assert sharding.logical_axes_by_path(state_of(toy.MLP(), np.ones((2, 4), np.float32))) == {}


def loop(mesh=None, n_microbatches=1):
    return train_loop(SMALL, mesh=mesh, n_steps=4, n_microbatches=n_microbatches)


def test_a_sharded_loop_on_one_device_trains_as_the_data_parallel_loop():
    data_parallel_loop = loop()
    data_parallel = [record.loss for record in data_parallel_loop]
    sharded_loop = loop(one_device_mesh(), n_microbatches=2)  # microbatches interleaved: the same mean
    sharded = [record.loss for record in sharded_loop]
    np.testing.assert_allclose(sharded, data_parallel, rtol=1e-5)
    assert sharded_loop.step == data_parallel_loop.step == 4
    for a, b in zip(jax.tree.leaves(sharded_loop.state), jax.tree.leaves(data_parallel_loop.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_sharded_eval_loop_on_one_device_evaluates_as_the_data_parallel_one():
    trained = loop(one_device_mesh())
    record = trained.next_checkpoint()
    model = lm.Transformer(SMALL)
    dataset = lm.batches(lm.text(), SMALL)
    task = fs.EvalTask(apply=model.apply, metrics={"loss": lm.loss}, data=[dataset.batch(i) for i in range(3)])
    sharded = fs.EvalLoop(task, jax.random.key(1), n_steps=3, mesh=one_device_mesh(), axis_rules=lm.RULES)
    data_parallel = fs.EvalLoop(task, jax.random.key(1), n_steps=3)
    newest = [evaluate(record).metrics["eval"]["loss"] for evaluate in (sharded, data_parallel)]  # the loop's arrays
    trained.next_checkpoint()  # the loop trains on: the record is now evaluated from its host copy
    older = [evaluate(record).metrics["eval"]["loss"] for evaluate in (sharded, data_parallel)]
    np.testing.assert_allclose(newest + older, [older[1]] * 4, rtol=1e-6)


def test_mesh_and_axis_rules_come_together():
    with pytest.raises(ValueError, match=re.escape("got only mesh")):
        fs.TrainLoop(init=lambda *_: {}, task=None, rng=0, mesh=one_device_mesh())
    with pytest.raises(ValueError, match="devices= or mesh=, not both"):
        fs.TrainLoop(init=lambda *_: {}, task=None, rng=0, mesh=one_device_mesh(), axis_rules=[], devices=[])
    task = fs.EvalTask(apply=None, metrics={"loss": lm.loss}, data=[])
    with pytest.raises(ValueError, match=re.escape("EvalLoop shards the state when given both mesh= and axis_rules=")):
        fs.EvalLoop(task, jax.random.key(0), axis_rules=lm.RULES)
    with pytest.raises(ValueError, match="EvalLoop takes devices= or mesh=, not both"):
        fs.EvalLoop(task, jax.random.key(0), mesh=one_device_mesh(), axis_rules=lm.RULES, devices=jax.devices())


def row_statistics() -> optax.GradientTransformation:
    """A hand-made factored optimizer state: one running mean of squared gradients per row of each kernel."""

    def init(params):
        return {"row": jax.tree.map(lambda p: np.zeros(p.shape[:-1] if p.ndim > 1 else p.shape, np.float32), params)}

    def update(updates, state, params=None):
        rows = jax.tree.map(
            lambda g, r: 0.9 * r + 0.1 * ((g**2).mean(axis=-1) if g.ndim > 1 else g**2), updates, state["row"]
        )
        return updates, {"row": rows}

    return optax.GradientTransformation(init, update)


def test_factored_optimizer_statistics_keep_the_axes_of_the_dimensions_they_keep():
    x = np.zeros((1, 8), np.int32)
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=2)
    state = jax.eval_shape(lambda: fs.FlaxOptimTrainState.create(tx, lm.Transformer(SMALL).init(jax.random.key(0), x)))
    factored = state.param_states[0]  # adafactor's FactoredState: v_row, v_col, v of each parameter
    kernel = "Block_0/Dense_0/kernel"  # (embed 16, mlp 32)
    axes = sharding.logical_axes_by_path(state)
    assert axes[f"state/param_states/0/v_row/{kernel}"] == ["embed"]
    assert axes[f"state/param_states/0/v_col/{kernel}"] == ["mlp"]
    assert f"state/param_states/0/v/{kernel}" not in axes  # a placeholder of shape (1,): replicated
    shardings = sharding.logical_shardings(state, one_device_mesh(), lm.RULES)
    assert shardings.param_states[0].v_row["Block_0"]["Dense_0"]["kernel"].spec == PartitionSpec("fsdp")
    assert shardings.param_states[0].v_col["Block_0"]["Dense_0"]["kernel"].spec == PartitionSpec("model")
    assert factored.v_row["Block_0"]["Dense_0"]["kernel"].shape == (16,)
    # A square kernel's row statistics could keep either axis: replicated.
    square = dataclasses.replace(SMALL, mlp=16)
    chained = optax.chain(row_statistics(), optax.sgd(0.1))
    state = jax.eval_shape(
        lambda: fs.FlaxOptimTrainState.create(chained, lm.Transformer(square).init(jax.random.key(0), x))
    )
    axes = sharding.logical_axes_by_path(state)
    assert f"state/param_states/0/row/{kernel}" not in axes
    assert axes["state/param_states/0/row/Embed_0/embedding"] == ["vocab"]  # (vocab 256, embed 16)


@pytest.mark.parametrize("optimizer", ["adafactor", "row statistics"])
def test_a_factored_optimizer_trains_under_a_mesh_as_without_one(optimizer):
    tx = (
        optax.adafactor(1e-2, min_dim_size_to_factor=2)
        if optimizer == "adafactor"
        else optax.chain(row_statistics(), optax.adam(1e-2))
    )
    data_parallel = train_loop(SMALL, n_steps=4, optimizer=tx)
    sharded = train_loop(SMALL, mesh=one_device_mesh(), n_steps=4, optimizer=tx)
    np.testing.assert_allclose([r.loss for r in sharded], [r.loss for r in data_parallel], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(sharded.state), jax.tree.leaves(data_parallel.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_one_partitioning_serves_the_loop_the_evaluation_and_the_data_as_the_old_keywords_did():
    where = fs.Partitioning(mesh=one_device_mesh(), axis_rules=[list(rule) for rule in lm.RULES])
    assert where.sharded and where.axis_rules == sharding.check_rules(one_device_mesh(), lm.RULES)  # checked once
    assert where.batch_layout is where.batch_layout and where.process_part() == (0, 1)
    by_keywords = train_loop(SMALL, mesh=one_device_mesh(), n_steps=2)
    by_partitioning = train_loop(SMALL, partitioning=where, n_steps=2)
    records = [next(iter(trained)) for trained in (by_keywords, by_partitioning)]
    assert records[0].loss == records[1].loss
    for a, b in zip(jax.tree.leaves(records[0].state), jax.tree.leaves(records[1].state), strict=True):
        np.testing.assert_array_equal(a, b)
    model = lm.Transformer(SMALL)
    task = fs.EvalTask(apply=model.apply, metrics={"loss": lm.loss}, data=[lm.batches(lm.text(), SMALL).batch(0)])
    evaluations = [
        fs.EvalLoop(task, jax.random.key(1), partitioning=where)(records[1]),
        fs.EvalLoop(task, jax.random.key(1), mesh=one_device_mesh(), axis_rules=lm.RULES)(records[1]),
    ]
    assert evaluations[0].metrics == evaluations[1].metrics
    x = np.arange(32.0).reshape(16, 2)
    batches = [
        fs.global_batches(x, 8, partitioning=where),
        fs.global_batches(x, 8, mesh=where.mesh, axis_rules=lm.RULES),
    ]
    np.testing.assert_array_equal(next(iter(batches[0])), next(iter(batches[1])))


def test_a_partitioning_refuses_what_the_keywords_refuse_and_is_not_given_twice():
    with pytest.raises(
        ValueError, match=re.escape("Partitioning shards the state when given both mesh= and axis_rules=")
    ):
        fs.Partitioning(mesh=one_device_mesh())
    with pytest.raises(ValueError, match="Partitioning takes devices= or mesh=, not both"):
        fs.Partitioning(devices=jax.devices(), mesh=one_device_mesh(), axis_rules=lm.RULES)
    with pytest.raises(ValueError, match="mesh axis 'nope', which the mesh does not have"):
        fs.Partitioning(mesh=one_device_mesh(), axis_rules=[("batch", "nope")])
    data_parallel = fs.Partitioning(devices=jax.devices()[:1])
    assert not data_parallel.sharded and data_parallel.devices == tuple(jax.devices()[:1])
    assert data_parallel.batch_layout is None and data_parallel.process_part() == (0, 1)
    with pytest.raises(ValueError, match=r"TrainLoop takes partitioning= or mesh=/axis_rules=, not both"):
        fs.TrainLoop(
            init=lambda *_: {}, task=None, rng=0, partitioning=data_parallel, mesh=one_device_mesh(), axis_rules=[]
        )
    with pytest.raises(ValueError, match=r"global_batches takes partitioning= or mesh=, not both"):
        fs.global_batches(np.ones((4, 2)), 2, partitioning=data_parallel, mesh=one_device_mesh())
    with pytest.raises(TypeError, match="EvalLoop partitioning= takes an fs.Partitioning, got Mesh"):
        task = fs.EvalTask(apply=None, metrics={"loss": lm.loss}, data=[])
        fs.EvalLoop(task, jax.random.key(0), partitioning=one_device_mesh())
