"""Gradient accumulation (`n_microbatches`): M microbatches a step, the update of the whole batch."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flaxstate_testing import toy
from jax.sharding import Mesh

import flaxstate as fs

MLP = toy.MLP()

# Mean of M microbatch means against the mean of the batch: equal up to float32 rounding.
ROUNDING = {"rtol": 1e-5, "atol": 1e-6}


def train(n_microbatches, optimizer, model=MLP, n_steps=6, per_dispatch=1, data=None, loss=toy.mse, **options):
    data = toy.batches(n_steps, 8) if data is None else data
    task = fs.TrainTask(apply=model.apply, optimizer=optimizer, loss=loss, data=data)
    loop = fs.TrainLoop(
        model.init,
        task,
        rng=0,
        n_steps=n_steps,
        n_steps_per_checkpoint=n_steps // 2,
        n_steps_per_dispatch=per_dispatch,
        n_microbatches=n_microbatches,
        stdout=False,
        **options,
    )
    return list(loop)


def assert_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **ROUNDING)


@pytest.mark.parametrize("optimizer", [optax.sgd(0.1), optax.adam(1e-2)], ids=["sgd", "adam"])
def test_four_microbatches_end_equal_to_the_whole_batch(optimizer):
    whole, micro = train(1, optimizer), train(4, optimizer)
    assert_close(micro[-1].state.params, whole[-1].state.params)
    assert_close(micro[-1].state.param_states, whole[-1].state.param_states)
    assert_close(micro[-1].grads, whole[-1].grads)
    np.testing.assert_allclose([r.loss for r in micro], [r.loss for r in whole], **ROUNDING)
    assert not np.allclose(whole[0].state.params["Dense_0"]["kernel"], whole[-1].state.params["Dense_0"]["kernel"])


def test_microbatches_compose_with_several_steps_a_dispatch():
    whole = train(1, optax.adam(1e-2), n_steps=12)
    micro = train(2, optax.adam(1e-2), n_steps=12, per_dispatch=3)
    assert_close(micro[-1].state.params, whole[-1].state.params)
    assert_close(micro[-1].grads, whole[-1].grads)


def test_batch_statistics_are_updated_once_per_microbatch_in_order():
    model = toy.BatchNormNet()
    data = toy.batches(2, 8)
    [record] = train(2, optax.sgd(0.0), model=model, n_steps=2, data=data)[:1]
    # Step 1 with two microbatches of 4, interleaved (examples 0, 2, 4, 6, then 1, 3, 5, 7, whatever the
    # placement): the running statistics move on the first microbatch, then the second.
    x = data[0][0]
    variables = model.init({"params": jax.random.fold_in(jax.random.fold_in(jax.random.key(0), 0), 0)}, x[:8])
    stats = variables["batch_stats"]
    for half in (x[0::2], x[1::2]):
        _, updated = model.apply(
            {"params": variables["params"], "batch_stats": stats},
            half,
            rngs={"dropout": jax.random.key(9)},
            mutable=["batch_stats"],
        )
        stats = updated["batch_stats"]
    assert_close(record.state.flax_mutables["batch_stats"], stats)
    _, whole = model.apply(variables, x, rngs={"dropout": jax.random.key(9)}, mutable=["batch_stats"])
    mean = "BatchNorm_0", "mean"
    assert not np.allclose(whole["batch_stats"][mean[0]][mean[1]], stats[mean[0]][mean[1]])


def test_a_batch_that_does_not_split_into_the_microbatches_names_both_before_anything_runs():
    task = fs.TrainTask(apply=MLP.apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=toy.batches(4, 8))
    with pytest.raises(ValueError, match=r"batch of size 8: 8 examples a device .* n_microbatches=3 .* multiple of 3"):
        fs.TrainLoop(MLP.init, task, rng=0, n_steps=4, n_microbatches=3, stdout=False)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="n_microbatches must be a positive int"):
            fs.TrainLoop(MLP.init, task, rng=0, n_steps=4, n_microbatches=bad, stdout=False)


def test_a_later_batch_that_does_not_split_is_named_at_its_step():
    data = toy.batches(2, 8) + toy.batches(2, 6, seed=3)
    with pytest.raises(ValueError, match=r"batch of size 6: 6 examples a device .* n_microbatches=4"):
        train(4, optax.sgd(0.1), n_steps=4, data=data)


class Bfloat16MLP(nn.Module):
    """Computes in bfloat16, keeps float32 parameters: the one-line change README shows."""

    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(32, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x))
        return nn.Dense(1, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x)[:, 0]


@pytest.mark.parametrize("n_microbatches", [1, 2])
def test_a_bfloat16_model_trains_with_float32_loss_gradients_state_and_checkpoints(tmp_path, n_microbatches):
    model = Bfloat16MLP()
    seen = []

    def loss(outputs, targets):
        seen.append(outputs.dtype)
        return jnp.mean((outputs - targets) ** 2)

    data = toy.batches(1, 16) * 40
    records = train(n_microbatches, optax.adam(1e-2), model=model, n_steps=40, data=data, loss=loss)
    assert set(seen) == {jnp.dtype(jnp.float32)}  # the model's bfloat16 outputs reach the loss as float32
    final = records[-1]
    for tree in (final.state.params, final.grads, final.state.param_states):
        assert {np.asarray(leaf).dtype for leaf in jax.tree.leaves(tree)} <= {np.dtype(np.float32), np.dtype(np.int32)}
    assert isinstance(final.loss, float) and final.loss < 0.5 * records[0].loss
    with fs.CheckpointFileWriter(tmp_path) as writer:
        writer(final)
    restored = fs.CheckpointFileReader(tmp_path).read(None)
    assert {leaf.dtype for leaf in jax.tree.leaves(restored.state["target"])} == {np.dtype(np.float32)}


@pytest.mark.parametrize("n_microbatches, n_magnitudes", [(1, 2), (2, 4)])
def test_dropout_masks_differ_per_microbatch(n_microbatches, n_magnitudes):
    # The probe's gradient is its dropout mask times a constant a microbatch: one mask gives two magnitudes
    # (0 and c), two different masks give four (0, c_0, c_1, c_0 + c_1) a.s.
    [record, _] = train(n_microbatches, optax.sgd(0.0), model=toy.DropoutProbe(), n_steps=2)
    magnitudes = np.unique(np.round(np.abs(np.asarray(record.grads["w"])), 4))
    assert len(magnitudes) == n_magnitudes, magnitudes


def test_microbatches_hold_the_same_examples_with_and_without_a_mesh():
    """BatchNorm statistics and dropout masks of M = 2 do not depend on the placement: a 1-device mesh equals none."""
    model = toy.BatchNormNet()
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("data",))

    def trained(**placement):
        task = fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=toy.batches(4, 8))
        loop = fs.TrainLoop(model.init, task, jax.random.key(0), n_steps=4, n_microbatches=2, stdout=False, **placement)
        return list(loop)[-1]

    with warnings.catch_warnings():  # the model names no logical axes: its state is replicated (warned once)
        warnings.simplefilter("ignore")
        sharded = trained(mesh=mesh, axis_rules=[("batch", "data")])
    plain = trained()
    for a, b in zip(jax.tree.leaves(sharded.state), jax.tree.leaves(plain.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    stats = plain.state.flax_mutables["batch_stats"]["BatchNorm_0"]["mean"]
    assert np.abs(stats).max() > 0


@pytest.mark.parametrize(
    ("device_batch", "most", "expected"), [(8, 8, 1), (8, 4, 2), (8, 3, 4), (6, 4, 2), (7, 4, 7), (12, 5, 3)]
)
def test_the_fewest_equal_microbatches_within_the_device_batch_are_chosen(device_batch, most, expected):
    assert fs.training.startup.microbatches_for(device_batch, most) == expected


def test_max_device_batch_sets_the_microbatches_from_each_device_s_batch_and_says_so(caplog):
    # A batch of 8 on one device with at most 3 at once: 4 microbatches of 2, as n_microbatches=4 gives them.
    with caplog.at_level("INFO", logger="flaxstate"):
        chosen = train(1, optax.adam(1e-2), max_device_batch=3)
    given = train(4, optax.adam(1e-2))
    assert chosen[-1].session.n_microbatches == 4 and chosen[-1].session.max_device_batch == 3
    for x, y in zip(jax.tree.leaves(chosen[-1].state), jax.tree.leaves(given[-1].state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # the same program: bit for bit
    assert "TrainLoop(max_device_batch=3): 4 microbatches a step, each device's 8 examples" in caplog.text
    roomy = train(1, optax.adam(1e-2), max_device_batch=8)
    assert roomy[-1].session.n_microbatches == 1 and roomy[-1].session.max_device_batch == 8


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_device_batch": 0}, "max_device_batch must be"),
        ({"max_device_batch": 4, "n_microbatches": 2}, "both set the microbatches"),
    ],
)
def test_max_device_batch_is_refused_when_it_cannot_be_one(options, message):
    n_microbatches = options.pop("n_microbatches", 1)
    with pytest.raises(ValueError, match=message):
        train(n_microbatches, optax.sgd(0.1), **options)
