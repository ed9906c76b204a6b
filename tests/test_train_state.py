import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import FrozenDict
from flax.linen import partitioning
from jax.sharding import PartitionSpec as P

from flaxstate import FlaxOptimTrainState, InferenceState, StateMismatchError, TrainState


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        train = self.is_mutable_collection("batch_stats")
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.5, deterministic=not self.has_rng("dropout"))(x)
        return nn.Dense(2)(x)


class AxesNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = partitioning.param_with_axes("w", nn.initializers.ones, (3, 4), axes=("embed", "mlp"))
        b = partitioning.param_with_axes("b", nn.initializers.zeros, (4,), axes=("mlp",))
        return x @ w + b


class BoxedNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(
            4,
            kernel_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)),
        )(x)
        return x


class HalfBoxedNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp")), (3, 4))
        b = self.param("b", nn.initializers.zeros, (4,))
        return x @ w + b


def net_variables():
    return Net().init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, jnp.ones((4, 3)))


def test_create_splits_params_and_mutables_from_plain_dict_and_frozendict():
    variables = net_variables()
    assert isinstance(variables, dict)
    for given in (variables, FrozenDict(variables)):
        state = FlaxOptimTrainState.create(optax.adam(1e-3), given)
        assert set(state.params) == {"Dense_0", "Dense_1", "BatchNorm_0"}
        assert set(state.flax_mutables) == {"batch_stats"}
        assert int(state.step) == 0
        assert state.params_axes is None
        assert isinstance(state, TrainState)


def test_create_requires_params():
    with pytest.raises(ValueError, match="no 'params' collection"):
        FlaxOptimTrainState.create(optax.sgd(0.1), {"batch_stats": {}})


def test_create_with_t5x_params_axes():
    variables = AxesNet().init(jax.random.key(0), jnp.ones((2, 3)))
    assert "params_axes" in variables
    state = FlaxOptimTrainState.create(optax.adam(1e-3), variables)
    assert set(state.params) == {"w", "b"}
    axes = state.as_logical_axes()
    assert axes.params == {"w": P("embed", "mlp"), "b": P("mlp")}
    mu = axes.param_states[0].mu
    assert mu == {"w": P("embed", "mlp"), "b": P("mlp")}
    assert axes.param_states[0].count == P()
    assert axes.step == P()


def test_create_unboxes_logical_metadata():
    variables = BoxedNet().init(jax.random.key(0), jnp.ones((2, 3)))
    state = FlaxOptimTrainState.create(optax.sgd(0.1, momentum=0.9), variables)
    assert isinstance(state.params["Dense_0"]["kernel"], jax.Array)
    assert state.as_logical_axes().params == {"Dense_0": {"kernel": P("embed", "mlp"), "bias": P("mlp")}}


def test_missing_axis_names_are_listed():
    variables = HalfBoxedNet().init(jax.random.key(0), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="not for: b"):
        FlaxOptimTrainState.create(optax.sgd(0.1), variables)


def test_as_logical_axes_without_axes_is_a_clear_error():
    state = FlaxOptimTrainState.create(optax.sgd(0.1), net_variables())
    with pytest.raises(ValueError, match="gave no logical axis names"):
        state.as_logical_axes()


@pytest.mark.parametrize("tx", [optax.adam(1e-2), optax.sgd(0.1, momentum=0.9)], ids=["adam", "sgd_momentum"])
def test_apply_gradient_equals_handwritten_optax(tx):
    variables = net_variables()
    state = FlaxOptimTrainState.create(tx, variables)
    params = variables["params"]
    opt_state = tx.init(params)
    for i in range(3):
        grads = jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)), state.params)
        state = state.apply_gradient(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    assert int(state.step) == 3
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_apply_gradient_replaces_mutables_when_given():
    state = FlaxOptimTrainState.create(optax.sgd(0.1), net_variables())
    grads = jax.tree.map(jnp.zeros_like, state.params)
    new_stats = jax.tree.map(lambda x: x + 1, state.flax_mutables)
    assert state.apply_gradient(grads).flax_mutables is state.flax_mutables
    updated = state.apply_gradient(grads, flax_mutables=new_stats)
    np.testing.assert_array_equal(updated.flax_mutables["batch_stats"]["BatchNorm_0"]["mean"], 1.0)


def test_learning_rate_changes_update_with_inject_hyperparams():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = FlaxOptimTrainState.create(tx, net_variables())
    grads = jax.tree.map(jnp.ones_like, state.params)
    default = state.apply_gradient(grads)
    halved = state.apply_gradient(grads, learning_rate=0.05)
    delta_default = default.params["Dense_0"]["bias"] - state.params["Dense_0"]["bias"]
    delta_halved = halved.params["Dense_0"]["bias"] - state.params["Dense_0"]["bias"]
    np.testing.assert_allclose(delta_default, -0.1)
    np.testing.assert_allclose(delta_halved, -0.05)


def test_learning_rate_without_inject_hyperparams_raises():
    state = FlaxOptimTrainState.create(optax.sgd(0.1), net_variables())
    grads = jax.tree.map(jnp.ones_like, state.params)
    with pytest.raises(ValueError, match="inject_hyperparams"):
        state.apply_gradient(grads, learning_rate=0.01)


ADAM = optax.adam(1e-2)


def trained_state(tx=ADAM):
    state = FlaxOptimTrainState.create(tx, net_variables())
    grads = jax.tree.map(jnp.cos, state.params)
    return state.apply_gradient(grads, flax_mutables=jax.tree.map(lambda x: x + 2, state.flax_mutables))


def test_state_dict_is_plain_and_in_checkpoint_layout():
    state_dict = trained_state().state_dict()
    assert set(state_dict) == {"target", "state", "flax_mutables"}
    assert set(state_dict["state"]) == {"step", "param_states"}

    def only_plain(node):
        if isinstance(node, dict):
            assert type(node) is dict
            for value in node.values():
                only_plain(value)
        else:
            assert isinstance(node, jax.Array | np.ndarray), type(node)

    only_plain(state_dict)


def test_state_dict_round_trip_is_exact():
    trained = trained_state()
    fresh = FlaxOptimTrainState.create(ADAM, net_variables())
    restored = fresh.restore_state(jax.tree.map(np.asarray, trained.state_dict()))
    assert int(restored.step) == 1
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.structure(restored) == jax.tree.structure(trained)


def test_restore_state_names_every_differing_path():
    state_dict = jax.tree.map(np.asarray, trained_state().state_dict())
    del state_dict["target"]["Dense_1"]["bias"]
    state_dict["target"]["Dense_9"] = {"kernel": np.zeros(3)}
    state_dict["target"]["Dense_0"]["kernel"] = np.zeros((5, 8), np.float32)
    state_dict["state"]["step"] = np.float32(1)
    fresh = FlaxOptimTrainState.create(ADAM, net_variables())
    with pytest.raises(StateMismatchError) as error:
        fresh.restore_state(state_dict)
    message = str(error.value)
    assert "missing (expected, not found): target/Dense_1/bias" in message
    assert "unexpected (found, not expected): target/Dense_9/kernel" in message
    assert "target/Dense_0/kernel (expected float32[3, 8], found float32[5, 8])" in message
    assert "state/step (expected int32[], found float32[])" in message


def test_restore_state_non_strict_restores_a_subtree():
    trained = trained_state()
    fresh = FlaxOptimTrainState.create(ADAM, net_variables())
    restored = fresh.restore_state({"target": trained.state_dict()["target"]}, strict=False)
    np.testing.assert_array_equal(restored.params["Dense_0"]["kernel"], trained.params["Dense_0"]["kernel"])
    assert int(restored.step) == 0
    np.testing.assert_array_equal(restored.flax_mutables["batch_stats"]["BatchNorm_0"]["mean"], 0.0)
    with pytest.raises(StateMismatchError, match="missing"):
        fresh.restore_state({"target": trained.state_dict()["target"]})


def test_state_goes_through_jit_and_pmap_with_donation():
    state = trained_state()
    grads = jax.tree.map(jnp.ones_like, state.params)

    def update(state, grads):
        return state.apply_gradient(grads)

    expected = jax.jit(update)(state, grads)
    jitted = jax.jit(update, donate_argnums=0)(jax.tree.map(jnp.copy, state), grads)
    stacked = jax.tree.map(lambda x: x[None], (state, grads))
    pmapped = jax.pmap(update, donate_argnums=0)(*stacked)
    for a, b, c in zip(jax.tree.leaves(expected), jax.tree.leaves(jitted), jax.tree.leaves(pmapped), strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c[0])


def test_inference_state_restores_from_training_state_dict():
    trained = trained_state()
    inference = InferenceState.create(net_variables()).restore_state(trained.state_dict())
    assert int(inference.step) == 1
    np.testing.assert_array_equal(inference.params["Dense_1"]["kernel"], trained.params["Dense_1"]["kernel"])
    np.testing.assert_array_equal(
        inference.flax_mutables["batch_stats"]["BatchNorm_0"]["var"],
        trained.flax_mutables["batch_stats"]["BatchNorm_0"]["var"],
    )
    assert set(inference.state_dict()["state"]) == {"step"}


def test_inference_state_cannot_train():
    inference = InferenceState.create(net_variables())
    with pytest.raises(NotImplementedError, match="no optimizer"):
        inference.apply_gradient(inference.params)
    assert inference.param_states is None


def test_both_states_answer_isinstance_of_the_protocol():
    # On Python 3.11 runtime_checkable evaluates properties: param_states must not raise.
    assert isinstance(InferenceState.create(net_variables()), TrainState)
    assert isinstance(FlaxOptimTrainState.create(optax.sgd(0.1), net_variables()), TrainState)
    assert not isinstance(net_variables(), TrainState)


def test_inference_state_restore_names_differing_paths():
    state_dict = jax.tree.map(np.asarray, trained_state().state_dict())
    del state_dict["flax_mutables"]["batch_stats"]["BatchNorm_0"]["mean"]
    with pytest.raises(StateMismatchError, match="flax_mutables/batch_stats/BatchNorm_0/mean"):
        InferenceState.create(net_variables()).restore_state(state_dict)


def test_replace_params_and_step():
    state = trained_state()
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    assert int(state.replace_step(7).step) == 7
    assert all(float(jnp.sum(x)) == 0 for x in jax.tree.leaves(state.replace_params(zeros).params))


@pytest.mark.parametrize("step", [1, np.array(1), np.int64(1), np.uint8(1), jnp.asarray(1, jnp.int32)])
def test_any_integer_step_restores_as_the_int32_counter(step):
    """T5X's restore_state cases: `{"state": {"step": np.array(1)}, ...}` or a plain 1, on both states."""
    trained = jax.tree.map(np.asarray, trained_state().state_dict())
    trained["state"]["step"] = step
    restored = FlaxOptimTrainState.create(ADAM, net_variables()).restore_state(trained)
    assert restored.step.dtype == jnp.int32 and int(restored.step) == 1
    inference = InferenceState.create(net_variables()).restore_state(trained)
    assert inference.step.dtype == jnp.int32 and int(inference.step) == 1
    partial = FlaxOptimTrainState.create(ADAM, net_variables()).restore_state({"state": {"step": step}}, strict=False)
    assert int(partial.step) == 1


def test_the_dtype_check_stays_strict_for_model_and_optimizer_arrays():
    state_dict = jax.tree.map(np.asarray, trained_state().state_dict())
    state_dict["target"]["Dense_0"]["bias"] = state_dict["target"]["Dense_0"]["bias"].astype(np.float64)
    state_dict["state"]["param_states"]["0"]["count"] = np.int64(1)
    with pytest.raises(StateMismatchError) as error:
        FlaxOptimTrainState.create(ADAM, net_variables()).restore_state(state_dict)
    assert "target/Dense_0/bias (expected float32[8], found float64[8])" in str(error.value)
    assert "state/param_states/0/count (expected int32[], found int64[])" in str(error.value)
    with pytest.raises(StateMismatchError, match=r"state/step \(expected int32\[\], found float32\[\]\)"):
        FlaxOptimTrainState.create(ADAM, net_variables()).restore_state(
            {"state": {"step": np.float32(1)}}, strict=False
        )
